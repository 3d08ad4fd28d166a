"""CompressedLinear: an nn.Linear whose weight lives zstd-compressed in RAM."""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from zstd_linear.codec import CodecConfig, EncodedWeight, encode_weight
from zstd_linear.compressed import CompressedModule
from zstd_linear.errors import ZstdLinearError
from zstd_linear.layout import dtype_name


class WeightSource(Protocol):
    """What serves a bound layer its decoded weight (the model's runtime)."""

    def linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, W, bias)`` with layer ``name``'s decoded weight W."""


class CompressedLinear(CompressedModule):
    """Drop-in for nn.Linear: ``y = x @ W.T + b`` with W decoded losslessly on demand.

    When and how long the decoded weight lives is the model's caching policy (see
    compress_model): the model's runtime binds each of its layers to itself and serves
    the weight. A layer built on its own (no runtime) decodes a fresh copy on every
    call and keeps nothing. Inference only.

    Args:
        encoded: the weight, (out_features, in_features), as ``zstd_linear.codec.
            encode_weight`` returns it.
        bias: (out_features,), any float dtype, or None; kept as a plain parameter
            (a copy).
        name: the fully qualified module name; it keys the layer in caches and files.

    Raises:
        ZstdLinearError: ``encoded`` is not 2-D, or ``bias`` is not (out_features,).
    """

    def __init__(self, encoded: EncodedWeight, bias: torch.Tensor | None = None, name: str = ""):
        super().__init__()
        if len(encoded.shape) != 2:
            raise ZstdLinearError(f"encoded weight must be 2-D, got shape {encoded.shape}")
        out_features, in_features = encoded.shape
        if bias is not None:
            if tuple(bias.shape) != (out_features,):
                raise ZstdLinearError(
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
        self._runtime: WeightSource | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        config: CodecConfig | None = None,
        name: str = "",
        executor: Executor | None = None,
    ) -> CompressedLinear:
        """Encode ``linear``'s weight into a standalone CompressedLinear (``linear`` is
        left as it is).

        Args:
            linear: an nn.Linear, its weight float32, bfloat16 or float16 on the CPU.
            config: the codec's settings (default ``CodecConfig()``).
            name: the fully qualified module name.
            executor: runs the chunks' zstd encodes in parallel, if given.

        Returns:
            CompressedLinear: same shapes and outputs, bit for bit.

        Raises:
            ZstdLinearError: ``linear`` is not an nn.Linear, or its dtype is not
                supported.
        """
        if not isinstance(linear, nn.Linear):
            raise ZstdLinearError(
                f"{name or 'module'} must be an nn.Linear, got {type(linear).__name__}"
            )
        dtype_name(linear.weight.dtype)  # raises for unsupported dtypes
        return cls(encode_weight(linear.weight, config, executor), linear.bias, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output, with the weight decoded through the runtime's policy.

        Args:
            x: (..., in_features), the weight's dtype.

        Returns:
            (..., out_features), bit-identical to the plain nn.Linear's output.

        Raises:
            RuntimeError: ``x`` requires grad with grad enabled (inference only).
        """
        if x.requires_grad and torch.is_grad_enabled():
            # The decoded weight's buffer is refilled by later decodes, so autograd
            # could not keep it for the backward pass.
            raise RuntimeError(
                f"CompressedLinear {self.name!r} is inference-only: call it under "
                "torch.no_grad() / torch.inference_mode(), or decompress_model first"
            )
        runtime = self._runtime
        if runtime is None:
            return F.linear(x, self.weight, self.bias)
        return runtime.linear(self.name, x, self.bias)

    def _shape_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
