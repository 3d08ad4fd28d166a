"""Policy ``resident``: decode every layer once and keep it."""

from __future__ import annotations

import torch

from zstd_linear.policies.base import BackingStore, CachePolicy


class Resident(CachePolicy):
    """Plain-model speed and memory after the first call of each layer."""

    name = "resident"

    def __init__(self, store: BackingStore):
        super().__init__(store)
        self._buffers: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}

    def acquire(self, name: str) -> torch.Tensor:
        weight = self._weights.get(name)
        if weight is None:
            buf = self._buffers[name] = self.store.pool.dedicated(self.store.nbytes(name))
            weight = self._weights[name] = self.store.decode(name, buf)
        return weight

    def keeps(self, name: str) -> bool:
        return True

    def close(self) -> None:
        for buf in self._buffers.values():
            self.store.pool.drop_dedicated(buf)
        self._buffers.clear()
        self._weights.clear()
