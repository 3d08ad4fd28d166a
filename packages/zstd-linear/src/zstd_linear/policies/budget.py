"""Policy ``budget``: a fixed set of decoded weights pinned under a byte budget, the rest
streamed by per_pass_prefetch.

Every pass calls the layers in the same cyclic order, so LRU evicts exactly the layer
needed next and hits nothing below the total decoded size. For a cyclic sequence the
optimal cache keeps a fixed set: the pinned layers are decoded once and kept; every
other layer is decoded ahead and freed after use, as under per_pass_prefetch.
"""

from __future__ import annotations

import numpy as np
import torch

from zstd_linear.errors import ZstdLinearError
from zstd_linear.policies.base import BackingStore, CachePolicy
from zstd_linear.policies.prefetch import PerPassPrefetch
from zstd_linear.sysmem import process_memory_limit, resident_bytes

# Decode cost per output byte, relative to a copy: a raw plane is a copy, a zstd plane
# costs its entropy decoding as well (zstd decodes ~4x slower than memcpy here), and a
# layout with planes pays a join over the whole weight.
_ZSTD_COST = 4.0
_BITPACK_COST = 2.0  # unpacked at about half of memcpy's speed (benchmarks/codec.py)
_FRAME_COST = {"raw": 1.0, "bitpack": _BITPACK_COST, "zstd": _ZSTD_COST}
_JOIN_COST = 1.0
DEFAULT_HEADROOM_BYTES = 64 << 20


def decode_cost(encoded) -> float:
    """A layer's decode time in units of copying one byte (for ranking layers only)."""
    cost = 0.0
    for c, chunk in enumerate(encoded.frames):
        planes = len(chunk)
        start, stop = encoded.chunk_range(c)
        plane_bytes = (stop - start) * (encoded.itemsize if planes == 1 else 1)
        for frame in chunk:
            cost += plane_bytes * _FRAME_COST[frame.kind]
        if planes > 1:
            cost += _JOIN_COST * (stop - start) * encoded.itemsize
    return cost


def choose_pinned(sizes: dict[str, int], costs: dict[str, float], budget: int) -> list[str]:
    """Names whose ``sizes`` (the bytes each costs to pin) fit ``budget``, chosen to
    leave the least decode cost: greedy by cost saved per byte pinned, then any smaller
    layer that still fits."""
    chosen, used = [], 0
    for name in sorted(sizes, key=lambda n: (-costs[n] / max(1, sizes[n]), n)):
        if used + sizes[name] <= budget:
            chosen.append(name)
            used += sizes[name]
    return chosen


def frame_addresses(store: BackingStore) -> list[int]:
    """One address inside each distinct mapping the store's file-backed frames live in."""
    seen: dict[int, int] = {}
    for encoded in store.encoded.values():
        for chunk in encoded.frames:
            for frame in chunk:
                if frame.file_backed and len(frame.data):
                    mapping = id(frame.data.obj)  # a memoryview of the file's mmap
                    if mapping not in seen:
                        seen[mapping] = np.frombuffer(frame.data, dtype=np.uint8).ctypes.data
    return list(seen.values())


class Budget(CachePolicy):
    """budget_bytes: int >= 0, decoded bytes to pin (0 = per_pass_prefetch, the total of
    every layer = resident). Or memory_limit: the whole process's limit in bytes, or
    ``"auto"`` for the cgroup's hard limit (the machine's memory where there is none).
    The pinned set then gets what is left after what the process holds resident now
    (``resident_bytes``: anonymous memory and the mapped libraries' pages), the prefetch
    window's slabs and stream buffer, ``headroom_bytes`` (activations, code not run
    yet) and the compressed bytes that live in a mapped file (the pages every streamed
    layer is decoded from; evicting them would read them from storage on every pass). A
    pinned layer is charged its decoded bytes less its file-backed compressed bytes,
    which it no longer reads. ``budget_bytes`` is then that memory. window: as for
    per_pass_prefetch.

    ``hit_rates`` lists, per finished pass, the fraction of layer calls served by a
    pinned weight without a decode.
    """

    name = "budget"

    def __init__(
        self,
        store: BackingStore,
        budget_bytes: int | None = None,
        *,
        memory_limit: int | str | None = None,
        headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
        window: int = 2,
    ):
        if memory_limit == "auto":
            memory_limit = process_memory_limit()
        for param, value in (
            ("budget_bytes", budget_bytes),
            ("memory_limit", memory_limit),
            ("headroom_bytes", headroom_bytes),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                kind = 'an int >= 0 or "auto"' if param == "memory_limit" else "an int >= 0"
                raise ZstdLinearError(f"{param} must be {kind}, got {value!r}")
        if (budget_bytes is None) == (memory_limit is None):
            raise ZstdLinearError(
                "give exactly one of budget_bytes (decoded bytes to pin) or memory_limit "
                f"(the process's limit), got budget_bytes={budget_bytes!r}, "
                f"memory_limit={memory_limit!r}"
            )
        stream = PerPassPrefetch(store, window=window)  # validates window
        super().__init__(store)
        self._stream = stream
        sizes = {n: e.original_bytes for n, e in store.encoded.items()}
        costs = {n: decode_cost(e) for n, e in store.encoded.items()}
        charges = sizes
        if memory_limit is not None:
            stored = {id(e): e for e in store.encoded.values()}.values()  # a tie counts once
            mapped = sum(e.file_backed_bytes for e in stored)
            reserve = window * store.pool.slab_bytes + store.stream_bytes + headroom_bytes
            held = resident_bytes(frame_addresses(store))
            budget_bytes = max(0, memory_limit - held - reserve - mapped)
            charges = {
                n: max(0, e.original_bytes - e.file_backed_bytes) for n, e in store.encoded.items()
            }
        self.budget_bytes = budget_bytes
        self.memory_limit = memory_limit
        self.pinned: frozenset[str] = frozenset(choose_pinned(charges, costs, budget_bytes))
        self.pinned_bytes = sum(sizes[n] for n in self.pinned)
        self._buffers: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self.hit_rates: list[float] = []
        self._hits = self._calls = 0

    def on_pass_start(self, index: int) -> None:
        if self._calls:
            self.hit_rates.append(self._hits / self._calls)
        self._hits = self._calls = 0
        self._stream.on_pass_start(index)

    def acquire(self, name: str) -> torch.Tensor:
        self._calls += 1
        if name not in self.pinned:
            return self._stream.acquire(name)
        weight = self._weights.get(name)
        if weight is not None:
            self._hits += 1
            return weight
        buf = self._buffers[name] = self.store.pool.dedicated(self.store.nbytes(name))
        weight = self._weights[name] = self.store.decode(name, buf)
        return weight

    def release(self, name: str) -> None:
        if name not in self.pinned:
            self._stream.release(name)

    def keeps(self, name: str) -> bool:
        return name in self.pinned

    def cached(self) -> list[str]:
        """The pinned layers decoded so far.

        Returns:
            Their fully qualified names, sorted.
        """
        return sorted(self._weights)

    def close(self) -> None:
        self._stream.close()
        for buf in self._buffers.values():
            self.store.pool.drop_dedicated(buf)
        self._buffers.clear()
        self._weights.clear()
