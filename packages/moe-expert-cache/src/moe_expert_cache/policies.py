"""Eviction policies behind one interface, shared by the live cache and the simulator.

Each policy keeps per-expert statistics of one layer (how often and when each expert was
requested) and ranks resident experts for eviction: the lowest ``priority`` goes first.
Ties break by older last use, then by lower expert id, so every policy is deterministic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar

import numpy as np

from moe_expert_cache.errors import ExpertCacheError


class EvictionPolicy(ABC):
    """Statistics of one layer's ``num_experts`` experts and the eviction order they imply."""

    name: ClassVar[str]

    def __init__(self, num_experts: int):
        if num_experts < 1:
            raise ExpertCacheError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts = num_experts
        self.frequency = np.zeros(num_experts, dtype=np.float64)
        self.last_use = np.full(num_experts, -1, dtype=np.int64)  # step of the latest request

    def record(self, experts: Iterable[int], step: int) -> None:
        """One token at ``step`` requested ``experts``."""
        for e in experts:
            self.frequency[e] += 1
            self.last_use[e] = step

    @abstractmethod
    def priority(self, experts: np.ndarray, step: int) -> np.ndarray:
        """Keep-priority of ``experts`` (int, (n,)) at ``step``: lowest is evicted first."""

    def choose_victims(self, candidates: Sequence[int], n: int, step: int) -> list[int]:
        """Up to ``n`` of ``candidates`` to evict, first victim first."""
        if n <= 0 or not candidates:
            return []
        cand = np.asarray(candidates, dtype=np.int64)
        order = np.lexsort((cand, self.last_use[cand], self.priority(cand, step)))
        return [int(e) for e in cand[order[:n]]]


class LRUPolicy(EvictionPolicy):
    """Least recently used."""

    name = "lru"

    def priority(self, experts: np.ndarray, step: int) -> np.ndarray:
        return self.last_use[experts].astype(np.float64)


class LFUPolicy(EvictionPolicy):
    """Least frequently used (counts since the start)."""

    name = "lfu"

    def priority(self, experts: np.ndarray, step: int) -> np.ndarray:
        return self.frequency[experts]


class LCPPolicy(EvictionPolicy):
    """Least critical priority: ``frequency * decay ** ((step - last_use) / horizon)``.

    Frequency says how much an expert matters; the decay forgets experts that stopped
    being used, so a once-hot expert does not squat a slot forever (LFU's failure).
    """

    name = "lcp"

    def __init__(self, num_experts: int, decay: float = 0.25, horizon: float = 128.0):
        super().__init__(num_experts)
        if not 0.0 < decay < 1.0:
            raise ExpertCacheError(f"decay must be in (0, 1), got {decay}")
        if horizon <= 0:
            raise ExpertCacheError(f"horizon must be > 0, got {horizon}")
        self.decay, self.horizon = decay, horizon

    def priority(self, experts: np.ndarray, step: int) -> np.ndarray:
        age = np.maximum(step - self.last_use[experts], 0) / self.horizon
        return self.frequency[experts] * self.decay**age


POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LCPPolicy, LRUPolicy, LFUPolicy)
}


def make_policy(name: str, num_experts: int) -> EvictionPolicy:
    if name not in POLICIES:
        raise ExpertCacheError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](num_experts)
