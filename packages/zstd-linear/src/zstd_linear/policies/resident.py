"""Policy ``resident``: decode every layer once and keep it."""

from __future__ import annotations

import torch

from zstd_linear.policies.base import CachePolicy


class Resident(CachePolicy):
    """Plain-model speed and memory after the first call of each layer."""

    name = "resident"

    def __init__(self, runtime):
        super().__init__(runtime)
        self._buffers: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}

    def acquire(self, layer) -> torch.Tensor:
        weight = self._weights.get(layer.name)
        if weight is None:
            buf = self._buffers[layer.name] = self.runtime.pool.dedicated(
                layer.encoded.original_bytes
            )
            weight = self._weights[layer.name] = self.runtime.decode_into(layer, buf)
        return weight

    def close(self) -> None:
        for buf in self._buffers.values():
            self.runtime.pool.drop_dedicated(buf)
        self._buffers.clear()
        self._weights.clear()
