"""CompressedLinear: an nn.Linear whose weight lives zstd-compressed in RAM."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from zstd_linear.codec import CodecConfig, EncodedWeight, encode_weight
from zstd_linear.compressed import CompressedModule
from zstd_linear.layout import dtype_name


class WeightSource(Protocol):
    """What serves a bound layer its decoded weight (the model's runtime)."""

    def linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, W, bias)`` with layer ``name``'s decoded weight W."""


class CompressedLinear(CompressedModule):
    """Drop-in for nn.Linear: ``y = x @ W.T + b`` with W decoded losslessly on demand.

    x: (..., in_features), the weight's dtype; returns (..., out_features). The bias
    stays a plain (out_features,) parameter (tiny). When and how long the decoded
    weight lives is the model's caching policy (see compress_model): the model's
    runtime binds each of its layers to itself and serves the weight. A layer built on
    its own (no runtime) decodes a fresh copy on every call and keeps nothing.

    name: the fully qualified module name; it keys the layer in caches and files.
    """

    def __init__(self, encoded: EncodedWeight, bias: torch.Tensor | None = None, name: str = ""):
        super().__init__()
        if len(encoded.shape) != 2:
            raise ValueError(f"encoded weight must be 2-D, got shape {encoded.shape}")
        out_features, in_features = encoded.shape
        if bias is not None:
            if tuple(bias.shape) != (out_features,):
                raise ValueError(
                    f"bias must have shape ({out_features},) for layer {name!r}, "
                    f"got {tuple(bias.shape)}"
                )
            bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.in_features = in_features
        self.out_features = out_features
        self.encoded = encoded
        self.name = name
        self.bias = bias
        # The runtime that owns this layer: bound by compress_model / load_compressed,
        # unbound by decompress_model.
        self._container: WeightSource | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        config: CodecConfig | None = None,
        name: str = "",
        executor: Executor | None = None,
    ) -> CompressedLinear:
        if not isinstance(linear, nn.Linear):
            raise ValueError(
                f"{name or 'module'} must be an nn.Linear, got {type(linear).__name__}"
            )
        dtype_name(linear.weight.dtype)  # raises for unsupported dtypes
        return cls(encode_weight(linear.weight, config, executor), linear.bias, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            # The decoded weight's buffer is refilled by later decodes, so autograd
            # could not keep it for the backward pass.
            raise RuntimeError(
                f"CompressedLinear {self.name!r} is inference-only: call it under "
                "torch.no_grad() / torch.inference_mode(), or decompress_model first"
            )
        container = self._container
        if container is None:
            return F.linear(x, self.weight, self.bias)
        return container.linear(self.name, x, self.bias)

    def _shape_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
