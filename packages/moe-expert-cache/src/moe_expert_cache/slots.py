"""Which experts of one layer sit in which of its ``capacity`` resident slots.

Pure bookkeeping (numpy, no MLX): the live cache and the state machine test share it.
Every slot always holds an expert, so a load is always a swap with a victim.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.policies import EvictionPolicy


def _expert_ids(ids: Iterable[int], num_experts: int, name: str) -> list[int]:
    """``ids`` as distinct ints in ``[0, num_experts)``; anything else is refused (a float
    or a repeated id is never rounded or dropped)."""
    ids = list(ids)
    if not all(
        isinstance(e, (int, np.integer)) and not isinstance(e, bool) and 0 <= e < num_experts
        for e in ids
    ):
        raise ExpertCacheError(f"{name} experts must be int ids in [0, {num_experts}), got {ids}")
    if len(set(ids)) != len(ids):
        raise ExpertCacheError(f"{name} experts repeat an expert: {ids}")
    return [int(e) for e in ids]


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
        if not top_k <= capacity <= num_experts:
            raise ExpertCacheError(
                f"capacity must be in [top_k={top_k}, num_experts={num_experts}], got {capacity}"
            )
        pinned = _expert_ids(pinned, num_experts, "pinned")
        initial = _expert_ids(initial or [], num_experts, "initial")
        if len(pinned) > capacity - top_k:
            raise ExpertCacheError(
                f"{len(pinned)} pinned experts leave fewer than top_k={top_k} free slots "
                f"of capacity {capacity}"
            )
        # The initial experts keep their slot order (a warm start restores it exactly);
        # pinned experts missing from them come next, then the lowest ids fill the rest.
        order = initial + [e for e in sorted(pinned) if e not in initial]
        if len(order) > capacity:
            raise ExpertCacheError(
                f"{len(initial)} initial and {len(pinned)} pinned experts do not fit "
                f"capacity {capacity}"
            )
        taken = set(order)
        order += [e for e in range(num_experts) if e not in taken][: capacity - len(order)]
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
                raise ExpertCacheError(f"swap {(slot, evicted, loaded)} does not match slot {slot}")
            if self.is_resident(loaded):
                raise ExpertCacheError(f"expert {loaded} is already resident")
        for slot, evicted, loaded in swaps:
            self.expert_to_slot[evicted] = -1
            self.expert_to_slot[loaded] = slot
            self.slot_to_expert[slot] = loaded
