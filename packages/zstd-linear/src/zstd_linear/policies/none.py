"""Policy ``none``: decode on every call into a reused slab, keep nothing."""

from __future__ import annotations

import torch

from zstd_linear.policies.base import CachePolicy


class NoCache(CachePolicy):
    """Least memory (one slab), most decoding: every call decodes its weight."""

    name = "none"

    def __init__(self, runtime):
        super().__init__(runtime)
        self._in_use: dict[str, torch.Tensor] = {}

    def acquire(self, layer) -> torch.Tensor:
        slab = self.runtime.pool.acquire_slab(layer.encoded.original_bytes)
        self._in_use[layer.name] = slab
        return self.runtime.decode_into(layer, slab)

    def release(self, layer) -> None:
        self.runtime.pool.release_slab(self._in_use.pop(layer.name))

    def close(self) -> None:
        for slab in self._in_use.values():
            self.runtime.pool.release_slab(slab)
        self._in_use.clear()
