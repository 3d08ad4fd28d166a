"""The caching-policy interface: when is a layer's weight decoded, and when dropped."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from zstd_linear.layer import CompressedLinear
    from zstd_linear.runtime import ModelRuntime


class CachePolicy(ABC):
    """One model's decoded-weight cache.

    CompressedLinear.forward brackets every F.linear with ``acquire`` (returns the
    decoded weight, (out, in), the layer's dtype) and ``release``; the pass clock
    calls ``on_pass_start`` when the root module's forward begins.
    """

    name: ClassVar[str]

    def __init__(self, runtime: ModelRuntime):
        self.runtime = runtime

    def on_pass_start(self, index: int) -> None:  # noqa: B027 - most policies ignore passes
        """A new forward pass of the root module begins."""

    @abstractmethod
    def acquire(self, layer: CompressedLinear) -> torch.Tensor: ...

    def release(self, layer: CompressedLinear) -> None:  # noqa: B027 - most keep the weight
        """The F.linear that used ``acquire``'s weight has returned."""

    @abstractmethod
    def close(self) -> None:
        """Give every buffer back; the policy is not used afterwards."""
