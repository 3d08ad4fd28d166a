"""Which experts of one layer sit in which of its ``capacity`` resident slots.

Pure bookkeeping (numpy, no MLX): the live cache and the state machine test share it.
Every slot always holds an expert, so a load is always a swap with a victim.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from moe_expert_cache.policies import EvictionPolicy


class ExpertSlots:
    """A bijection between ``capacity`` slots and a subset of ``num_experts`` experts.

    ``slot_to_expert``: int32 (capacity,); ``expert_to_slot``: int32 (num_experts,), -1 when
    the expert is not resident. ``pinned`` experts are resident and never evicted.
    """

    def __init__(
        self,
        num_experts: int,
        capacity: int,
        top_k: int,
        pinned: Iterable[int] = (),
        initial: Sequence[int] | None = None,
    ):
        pinned = sorted({int(e) for e in pinned})
        if not top_k <= capacity <= num_experts:
            raise ValueError(
                f"capacity must be in [top_k={top_k}, num_experts={num_experts}], got {capacity}"
            )
        if any(not 0 <= e < num_experts for e in pinned):
            raise ValueError(f"pinned experts must be in [0, {num_experts}), got {pinned}")
        if len(pinned) > capacity - top_k:
            raise ValueError(
                f"{len(pinned)} pinned experts leave fewer than top_k={top_k} free slots "
                f"of capacity {capacity}"
            )
        order = list(pinned)
        for e in list(initial or []) + list(range(num_experts)):
            if len(order) == capacity:
                break
            if not 0 <= e < num_experts:
                raise ValueError(f"initial experts must be in [0, {num_experts}), got {e}")
            if e not in order:
                order.append(int(e))
        self.num_experts, self.capacity, self.top_k = num_experts, capacity, top_k
        self.pinned = frozenset(pinned)
        self.slot_to_expert = np.asarray(order, dtype=np.int32)
        self.expert_to_slot = np.full(num_experts, -1, dtype=np.int32)
        self.expert_to_slot[self.slot_to_expert] = np.arange(capacity, dtype=np.int32)

    def resident(self) -> set[int]:
        return {int(e) for e in self.slot_to_expert}

    def is_resident(self, expert: int) -> bool:
        return bool(self.expert_to_slot[expert] >= 0)

    def plan(
        self,
        wanted: Sequence[int],
        protected: Iterable[int],
        policy: EvictionPolicy,
        step: int,
        limit: int | None = None,
    ) -> list[tuple[int, int, int]]:
        """Swaps ``(slot, evicted, loaded)`` bringing in up to ``limit`` of ``wanted``.

        ``wanted`` lists non-resident experts, most wanted first. Victims are never pinned
        and never in ``protected`` (the experts the current tokens requested).
        """
        wanted = [int(e) for e in dict.fromkeys(wanted) if not self.is_resident(e)]
        n = len(wanted) if limit is None else min(len(wanted), limit)
        protected = set(protected) | self.pinned
        candidates = [int(e) for e in self.slot_to_expert if int(e) not in protected]
        victims = policy.choose_victims(candidates, n, step)
        return [(int(self.expert_to_slot[v]), v, w) for v, w in zip(victims, wanted, strict=False)]

    def apply(self, swaps: Sequence[tuple[int, int, int]]) -> None:
        """Commit swaps from :meth:`plan` (validated first, so a bad list changes nothing)."""
        for slot, evicted, loaded in swaps:
            if self.slot_to_expert[slot] != evicted or evicted in self.pinned:
                raise ValueError(f"swap {(slot, evicted, loaded)} does not match slot {slot}")
            if self.is_resident(loaded):
                raise ValueError(f"expert {loaded} is already resident")
        for slot, evicted, loaded in swaps:
            self.expert_to_slot[evicted] = -1
            self.expert_to_slot[loaded] = slot
            self.slot_to_expert[slot] = loaded
