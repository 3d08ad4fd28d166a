"""One MoE layer's cache: resident slots, device lookup tables, statistics, index buffer."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from moe_expert_cache.cached_layers import write_slots
from moe_expert_cache.policies import EvictionPolicy
from moe_expert_cache.slots import ExpertSlots

if TYPE_CHECKING:
    from moe_expert_cache.expert_store import ExpertStore
    from moe_expert_cache.trace import RouterTrace


@dataclass
class LayerMetrics:
    """Counters of one layer. A request is one (token, expert) pair the router chose.

    ``hits``: requests whose expert was resident, or read ahead by the speculative
    prefetch, when the layer computed; ``misses``: the others (each waited for its read, or
    was skipped). ``skipped``: misses computed without their expert (skip mode).
    ``swaps``: experts loaded into a slot after the initial fill; ``bytes_read``: the bytes
    read from the shards for them and for prefetched experts that were not used.
    ``prefetched``: experts read ahead by the speculative prefetch; ``prefetch_used``: of
    those, the ones loaded into a slot (the layer asked for them). ``stall_s``: seconds the
    forward spent on expert loads (reads done in the forward, waits for the prefetch,
    slot writes); a timing, so not compared when two metrics are compared.
    """

    requests: int = 0
    hits: int = 0
    misses: int = 0
    skipped: int = 0
    swaps: int = 0
    bytes_read: int = 0
    prefetched: int = 0
    prefetch_used: int = 0
    stall_s: float = field(default=0.0, compare=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


class LayerCache:
    """The expert cache of the MoE block at ``block_path`` (MoE layer number ``index``).

    Device-side tables rebuilt after every swap: ``lookup``: uint32 (num_experts,) expert ->
    slot (a miss maps to slot 0, whose output the skip path zeroes); ``hit_mask``: bool
    (num_experts,). ``buffer`` holds ``(indices (N, k), hit (N, k))`` per forward, lazy
    in skip mode, until :meth:`consume` reads them between tokens.
    """

    def __init__(
        self,
        index: int,
        block_path: str,
        store: ExpertStore,
        slots: ExpertSlots,
        policy: EvictionPolicy,
        skip: bool,
    ):
        self.index, self.block_path, self.store = index, block_path, store
        self.slots, self.policy, self.skip = slots, policy, skip
        self.metrics = LayerMetrics()
        self.expert_nbytes = store.expert_nbytes(block_path)
        self.projections: dict[str, nn.Module] = {}  # SwitchLinear / QuantizedSwitchLinear
        self.buffer: list[tuple[mx.array | np.ndarray, mx.array | np.ndarray | None]] = []
        self.tokens_seen = 0
        self._prefetch: Future | None = None
        self._refresh_tables()

    @property
    def full(self) -> bool:
        """Whether every expert of the layer is resident (nothing can miss)."""
        return self.slots.capacity == self.slots.num_experts

    def _refresh_tables(self) -> None:
        e2s = self.slots.expert_to_slot
        # When slot == expert id the remap is the identity and can be skipped.
        self.identity = bool((e2s == np.arange(len(e2s))).all())
        self.lookup = mx.array(np.maximum(e2s, 0).astype(np.uint32))
        self.hit_mask = mx.array(e2s >= 0)

    def read_resident(self) -> dict[str, dict[str, list[mx.array]]]:
        """The resident experts' tensors in slot order: ``{proj: {param: [row per slot]}}``."""
        rows = [self.store.read_expert(self.block_path, int(e)) for e in self.slots.slot_to_expert]
        return {
            proj: {param: [r[proj][param] for r in rows] for param in rows[0][proj]}
            for proj in rows[0]
        }

    def swap_in(self, swaps: list[tuple[int, int, int]], staged: dict | None = None) -> None:
        """Load each ``(slot, evicted, loaded)`` expert into its slot: from ``staged``
        (expert -> rows read ahead by the prefetch; used entries are removed) or from disk."""
        if not swaps:
            return
        start = time.perf_counter()
        staged = {} if staged is None else staged
        used = sum(e in staged for _, _, e in swaps)
        loaded = [
            staged.pop(e) if e in staged else self.store.read_expert(self.block_path, e)
            for _, _, e in swaps
        ]
        slot_ids = [s for s, _, _ in swaps]
        for proj, module in self.projections.items():
            write_slots(
                module, slot_ids, {p: [r[proj][p] for r in loaded] for p in loaded[0][proj]}
            )
        self.slots.apply(swaps)
        self.metrics.swaps += len(swaps)
        self.metrics.prefetch_used += used
        self.metrics.bytes_read += (len(swaps) - used) * self.expert_nbytes
        self._refresh_tables()
        self.metrics.stall_s += time.perf_counter() - start

    def record(self, indices: mx.array | np.ndarray, hit: mx.array | np.ndarray | None) -> None:
        """Buffer one forward's router choices ``indices`` (N, k) and their ``hit`` (N, k)
        bool, ``None`` when every expert was resident."""
        self.buffer.append((indices, hit))

    def ensure_resident(self, indices: np.ndarray, staged: dict | None = None) -> None:
        """Exact mode: load every expert ``indices`` (N, k) needs, before the layer computes;
        ``staged``: rows read ahead by the prefetch (see :meth:`swap_in`)."""
        counts = Counter(int(e) for e in indices.ravel())
        wanted = [e for e, _ in counts.most_common() if not self.slots.is_resident(e)]
        swaps = self.slots.plan(wanted, counts, self.policy, self.tokens_seen)
        if len(swaps) < len(wanted):
            raise RuntimeError(
                f"layer {self.index}: {len(wanted)} missing experts but only "
                f"{len(swaps)} evictable slots (capacity {self.slots.capacity})"
            )
        self.swap_in(swaps, staged)

    def start_prefetch(self, guessed: np.ndarray, executor: Executor) -> list[int]:
        """Start reading, on ``executor``, the experts of the guess ``guessed`` (N, k) int
        that are not resident: the most guessed first, at most ``top_k`` of them. Returns
        them. Nothing is evicted: :meth:`take_prefetched` hands the rows to the layer.
        """
        self.take_prefetched()  # a guess left by an interrupted forward is dropped
        counts = Counter(int(e) for e in guessed.ravel())
        wanted = [e for e, _ in counts.most_common() if not self.slots.is_resident(e)]
        wanted = wanted[: self.slots.top_k]
        if wanted:
            self.metrics.prefetched += len(wanted)
            self.metrics.bytes_read += len(wanted) * self.expert_nbytes
            self._prefetch = executor.submit(self._read_experts, wanted)
        return wanted

    def _read_experts(self, experts: list[int]) -> dict[int, dict]:
        return {e: self.store.read_expert(self.block_path, e) for e in experts}

    def take_prefetched(self) -> dict[int, dict[str, dict[str, mx.array]]]:
        """Wait for the prefetch started for this layer (the wait counts as stall time) and
        return its rows, expert -> ``{proj: {param: row}}``, of the experts still not
        resident; ``{}`` when none was started. A failed read raises here."""
        future, self._prefetch = self._prefetch, None
        if future is None:
            return {}
        start = time.perf_counter()
        try:
            staged = future.result()
        finally:
            self.metrics.stall_s += time.perf_counter() - start
        return {e: rows for e, rows in staged.items() if not self.slots.is_resident(e)}

    def token_groups(self, indices: np.ndarray) -> list[tuple[int, int]]:
        """Consecutive token ranges whose experts fit the cache together (exact mode).

        indices: (N, k). Each range needs at most ``capacity - len(pinned)`` unpinned experts.
        """
        room = self.slots.capacity - len(self.slots.pinned)
        groups, start, need = [], 0, set()
        for t, row in enumerate(indices):
            row_need = {int(e) for e in row} - self.slots.pinned
            if len(need | row_need) > room:
                groups.append((start, t))
                start, need = t, set()
            need |= row_need
        groups.append((start, len(indices)))
        return groups

    def consume(self, trace: RouterTrace | None) -> Counter:
        """Fold the buffered forwards into metrics and policy statistics; empty the buffer.

        Returns how often each expert was requested, for the between-token update.
        """
        counts: Counter = Counter()
        for indices, hit in self.buffer:
            idx = np.asarray(indices).reshape(-1, indices.shape[-1])
            n_hits = idx.size if hit is None else int(np.asarray(hit).sum())
            self.metrics.requests += idx.size
            self.metrics.hits += n_hits
            self.metrics.misses += idx.size - n_hits
            if self.skip:
                self.metrics.skipped += idx.size - n_hits
            for row in idx:
                self.policy.record(row.tolist(), self.tokens_seen)
                if trace is not None:
                    trace.append(self.index, self.tokens_seen, row)
                self.tokens_seen += 1
            counts.update(idx.ravel().tolist())
        self.buffer.clear()
        return counts
