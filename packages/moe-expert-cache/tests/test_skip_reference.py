"""Skip mode against an independent per-token reference of each router."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from membound_testing.random_moe import ARCHITECTURES
from moe_expert_cache import ExpertCacheConfig, load_cached_model


def silu(v):
    return v / (1 + np.exp(-v))


def softmax(v):
    e = np.exp(v - v.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference(stock_block, arch: str, x: np.ndarray, resident: set[int]) -> np.ndarray:
    """Dense per-token MoE output with the non-resident experts dropped. x: (N, D)."""
    k = 2
    gate_w = np.array(stock_block.gate.weight, dtype=np.float64)  # (E, D)
    sw = stock_block.switch_mlp
    w = {
        p: np.array(getattr(sw, p).weight, dtype=np.float64)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    normalised = arch == "mixtral" or bool(getattr(stock_block, "norm_topk_prob", False))
    out = np.zeros_like(x, dtype=np.float64)
    for n, xt in enumerate(x.astype(np.float64)):
        logits = gate_w @ xt
        top = np.argsort(-logits)[:k]
        scores = softmax(logits[top]) if arch == "mixtral" else softmax(logits)[top]
        if arch != "mixtral" and normalised:
            scores = scores / scores.sum()
        keep = np.array([e in resident for e in top])
        scores = np.where(keep, scores, 0.0)
        if normalised and not keep.all() and scores.sum() > 0:
            scores = scores / scores.sum()
        for e, s in zip(top, scores, strict=True):
            h = silu(w["gate_proj"][e] @ xt) * (w["up_proj"][e] @ xt)
            out[n] += s * (w["down_proj"][e] @ h)
    if arch == "qwen2_moe":
        se = stock_block.shared_expert
        xm = mx.array(x)
        out += np.array(mx.sigmoid(stock_block.shared_expert_gate(xm)) * se(xm))
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_skip_mode_matches_reference(model_dir, stock_run, arch):
    _, _, stock = stock_run(arch)
    resident = {0, 2, 3, 5, 6}
    cached = load_cached_model(
        model_dir(arch), ExpertCacheConfig(capacity=5, mode="skip", initial={0: sorted(resident)})
    )
    layer = cached.model.layers[0]
    block = layer.block_sparse_moe if arch == "mixtral" else layer.mlp
    stock_layer = stock.layers[0]
    stock_block = stock_layer.block_sparse_moe if arch == "mixtral" else stock_layer.mlp
    x = np.random.default_rng(0).normal(size=(1, 12, 64)).astype(np.float32)
    got = np.array(block(mx.array(x)))[0]
    want = reference(stock_block, arch, x[0], resident)
    assert cached.manager.layers[0].buffer  # the cached path ran and recorded its routing
    hit = np.array(cached.manager.layers[0].buffer[-1][1])
    assert not hit.all()  # some token really fell back
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_skip_path_with_every_needed_expert_resident_equals_stock_block(model_dir, stock_run, arch):
    """The masking path itself (not the full-capacity shortcut) leaves hits untouched."""
    _, _, stock = stock_run(arch)
    stock_layer = stock.layers[0]
    stock_block = stock_layer.block_sparse_moe if arch == "mixtral" else stock_layer.mlp
    x = mx.array(np.random.default_rng(1).normal(size=(1, 2, 64)).astype(np.float32))
    gates = np.array(stock_block.gate(x))[0]  # (2, E)
    needed = sorted({int(e) for row in gates for e in np.argsort(-row)[:2]})
    capacity = max(len(needed), 2)
    cached = load_cached_model(
        model_dir(arch), ExpertCacheConfig(capacity=capacity, mode="skip", initial={0: needed})
    )
    assert capacity < 8 and not cached.manager.layers[0].full
    layer = cached.model.layers[0]
    block = layer.block_sparse_moe if arch == "mixtral" else layer.mlp
    got = block(x)
    assert np.array(cached.manager.layers[0].buffer[-1][1]).all()  # every request hit
    np.testing.assert_allclose(np.array(got), np.array(stock_block(x)), atol=1e-6, rtol=0)
