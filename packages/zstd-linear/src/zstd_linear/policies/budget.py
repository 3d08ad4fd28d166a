"""Policy ``budget``: decoded weights kept under a byte budget, least recently used out."""

from __future__ import annotations

from collections import OrderedDict

import torch

from zstd_linear.policies.base import CachePolicy


class Budget(CachePolicy):
    """Keeps up to ``budget_bytes // slab_bytes`` decoded weights (one slab each).

    budget_bytes: int >= the largest compressed layer's weight bytes.
    """

    name = "budget"

    def __init__(self, runtime, budget_bytes: int):
        slab = runtime.pool.slab_bytes
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise ValueError(f"budget_bytes must be an int, got {budget_bytes!r}")
        if budget_bytes < slab:
            raise ValueError(
                f"budget_bytes must be >= {slab} (the largest layer's weight), got {budget_bytes}"
            )
        super().__init__(runtime)
        self.capacity = budget_bytes // slab
        self._lru: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def acquire(self, layer) -> torch.Tensor:
        hit = self._lru.get(layer.name)
        if hit is not None:
            self._lru.move_to_end(layer.name)
            return hit[1]
        if len(self._lru) >= self.capacity:
            _, (slab, _) = self._lru.popitem(last=False)
            self.runtime.pool.release_slab(slab)
        slab = self.runtime.pool.acquire_slab()
        weight = self.runtime.decode_into(layer, slab)
        self._lru[layer.name] = (slab, weight)
        return weight

    def cached(self) -> list[str]:
        """Names of the layers whose weights are decoded, least recently used first."""
        return list(self._lru)

    def close(self) -> None:
        for slab, _ in self._lru.values():
            self.runtime.pool.release_slab(slab)
        self._lru.clear()
