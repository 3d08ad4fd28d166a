"""CompressedLinear as a drop-in for nn.Linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zstd_linear import CompressedLinear, ZstdLinearError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_equals_linear_bit_for_bit(dtype, bias):
    torch.manual_seed(1)
    linear = nn.Linear(48, 24, bias=bias, dtype=dtype)
    layer = CompressedLinear.from_linear(linear, name="proj")
    x = torch.randn(5, 7, 48).to(dtype)
    with torch.no_grad():
        assert torch.equal(layer(x), linear(x))
    assert torch.equal(layer.weight, linear.weight.detach())
    assert (layer.in_features, layer.out_features) == (48, 24)


def test_non_linear_target_is_rejected():
    with pytest.raises(ZstdLinearError, match=r"must be an nn\.Linear, got Embedding"):
        CompressedLinear.from_linear(nn.Embedding(10, 4), name="embed")


def test_unsupported_dtype_is_rejected():
    with pytest.raises(ZstdLinearError, match="dtype must be one of"):
        CompressedLinear.from_linear(nn.Linear(4, 4, dtype=torch.float64))


def test_bias_of_wrong_shape_is_rejected():
    layer = CompressedLinear.from_linear(nn.Linear(4, 3))
    with pytest.raises(ZstdLinearError, match=r"bias must have shape \(3,\)"):
        CompressedLinear(layer.encoded, torch.zeros(4), name="x")


def test_autograd_through_a_compressed_layer_is_refused():
    linear = nn.Linear(4, 3)
    layer = CompressedLinear.from_linear(linear, name="head")
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="'head' is inference-only"):
        layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), linear(x))


def test_buffers_made_under_inference_mode_work_after_it():
    linear = nn.Linear(8, 8)
    layer = CompressedLinear.from_linear(linear)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        first = layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), first)
        assert torch.equal(first, linear(x))
