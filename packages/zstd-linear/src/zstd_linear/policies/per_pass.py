"""Policy ``per_pass``: the seed design, decode once per forward pass."""

from __future__ import annotations

import torch

from zstd_linear.policies.base import CachePolicy


class PerPass(CachePolicy):
    """Each layer decodes on its first call in a pass and reuses the weight within it.

    As in the seed, every layer keeps its own buffer between passes (refilled, never
    reallocated), so the peak is all decoded weights: use ``per_pass_prefetch`` to
    bound it.
    """

    name = "per_pass"

    def __init__(self, runtime):
        super().__init__(runtime)
        self._buffers: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._decoded_in: dict[str, int] = {}

    def acquire(self, layer) -> torch.Tensor:
        now = self.runtime.clock.index
        if self._decoded_in.get(layer.name) != now:
            buf = self._buffers.get(layer.name)
            if buf is None:
                buf = self._buffers[layer.name] = self.runtime.pool.dedicated(
                    layer.encoded.original_bytes
                )
            self._weights[layer.name] = self.runtime.decode_into(layer, buf)
            self._decoded_in[layer.name] = now
        return self._weights[layer.name]

    def close(self) -> None:
        for buf in self._buffers.values():
            self.runtime.pool.drop_dedicated(buf)
        self._buffers.clear()
        self._weights.clear()
        self._decoded_in.clear()
