"""Policy ``none``: decode on every call into a reused slab, keep nothing."""

from __future__ import annotations

import torch

from zstd_linear.policies.base import BackingStore, CachePolicy


class NoCache(CachePolicy):
    """Least memory (one slab), most decoding: every call decodes its weight."""

    name = "none"

    def __init__(self, store: BackingStore):
        super().__init__(store)
        self._in_use: dict[str, torch.Tensor] = {}

    def acquire(self, name: str) -> torch.Tensor:
        slab = self.store.pool.acquire_slab(self.store.nbytes(name))
        self._in_use[name] = slab
        return self.store.decode(name, slab)

    def release(self, name: str) -> None:
        self.store.pool.release_slab(self._in_use.pop(name))

    def close(self) -> None:
        for slab in self._in_use.values():
            self.store.pool.release_slab(slab)
        self._in_use.clear()
