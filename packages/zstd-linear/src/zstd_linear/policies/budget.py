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
from zstd_linear.policies.prefetch import PerPassPrefetch, check_read_ahead
from zstd_linear.sysmem import process_memory_limit, resident_bytes

# Decode cost per output byte, relative to a copy: a raw plane is a copy, a zstd plane
# costs its entropy decoding as well (zstd decodes ~4x slower than memcpy here), and a
# layout with planes pays a join over the whole weight.
_ZSTD_COST = 4.0
_BITPACK_COST = 2.0  # unpacked at about half of memcpy's speed (benchmarks/codec.py)
_FRAME_COST = {"raw": 1.0, "bitpack": _BITPACK_COST, "zstd": _ZSTD_COST}
_JOIN_COST = 1.0
DEFAULT_HEADROOM_BYTES = 64 << 20
#: The pass at whose start the page-cache plan is made again (see Budget): the first
#: pass has run the model's code and allocated its buffers by then, which the plan made
#: at load cannot see (SmolLM2 stacked under 480 MiB, 2026-12-07, one run each: 75 MiB
#: of room at load, 57-67 at passes 2-6; caching 78 MiB read 149 MiB a token, 64 MiB 137).
REPLAN_PASS = 2
#: Compressed bytes read ahead where frames are dropped (``Budget``'s read_ahead_bytes
#: None). SmolLM2 stacked under 480 MiB read at 200 MB/s (tokens/s, MiB read a token;
#: 2026-12-07): none 0.88-1.01, 135-136; 1 MiB 1.07-1.23, 137; 2 MiB 1.13-1.27,
#: 139-142; 4 MiB 0.98-1.24 (seven runs, median 1.09), 136-140; 8 MiB 1.14-1.17,
#: 146-151 (pages read ahead were evicted before their decode and read again). Runs of
#: one setting move 10-25% here; 1-2 runs each but 4 MiB.
READ_AHEAD_BYTES = 4 << 20


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


def choose_cached(sizes: dict[str, int], room: int) -> list[str]:
    """Keys of ``sizes`` (the compressed bytes each weight reads from its file every
    pass) whose frames fit ``room`` bytes of page cache together, the largest first,
    then any smaller one that still fits. Every frame is read once a pass, so each byte
    kept cached is a byte not read again, whichever weight holds it."""
    chosen, used = [], 0
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        if used + sizes[key] <= room:
            chosen.append(key)
            used += sizes[key]
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

    Where even the mapped compressed bytes do not fit what is left (``page_cache_room``
    < their total: nothing is pinned), streaming every weight through the page cache
    would evict each frame before the next pass reads it again. The policy then keeps
    the frames of as many bytes of weights as fit in the page cache
    (``cached_frames``, by ``choose_cached``) and drops every other weight's frames as
    soon as they are decoded (``pages_out``; ``Decoder.page_out``), so each pass reads
    from storage only the frames it does not keep. Such a plan is made at load and again
    when the second pass starts (``REPLAN_PASS``), from what the process holds then.
    The dropped frames are then read ahead of their decode (``read_ahead_bytes``, as
    per_pass_prefetch's; None: ``READ_AHEAD_BYTES``). Those pages are counted in
    ``headroom_bytes`` (meant for activations and code not run yet, which the second
    plan finds mostly run and measured); only a read-ahead larger than the headroom
    takes its excess from the room the frames are kept in. Where every frame fits,
    nothing is read ahead.

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
        read_ahead_bytes: int | None = None,
    ):
        if read_ahead_bytes is not None:
            check_read_ahead(read_ahead_bytes)
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
        self.memory_limit = memory_limit
        self._reserve = window * store.pool.slab_bytes + store.stream_bytes + headroom_bytes
        self._headroom = headroom_bytes
        self._read_ahead = READ_AHEAD_BYTES if read_ahead_bytes is None else read_ahead_bytes
        #: bytes of page cache the frames may use (None without ``memory_limit``)
        self.page_cache_room: int | None = None
        #: the layers whose compressed frames stay in the page cache between passes
        self.cached_frames: frozenset[str] = frozenset(store.encoded)
        self._dropped: frozenset[str] = frozenset()
        self._replan = False
        if memory_limit is not None:
            room = self._plan_page_cache()
            self._replan = bool(self._dropped)  # see on_pass_start
            budget_bytes = max(0, room - self._mapped_bytes())
            charges = {
                n: max(0, e.original_bytes - e.file_backed_bytes) for n, e in store.encoded.items()
            }
        self.budget_bytes = budget_bytes
        self.pinned: frozenset[str] = frozenset(choose_pinned(charges, costs, budget_bytes))
        self.pinned_bytes = sum(sizes[n] for n in self.pinned)
        self._buffers: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self.hit_rates: list[float] = []
        self._hits = self._calls = 0

    def _mapped_bytes(self) -> int:
        """The compressed bytes the layers read from a mapped file (a tie counts once)."""
        stored = {id(e): e for e in self.store.encoded.values()}.values()
        return sum(e.file_backed_bytes for e in stored)

    def _plan_page_cache(self) -> int:
        """Measure what the process holds now and choose the frames kept in the page
        cache (``cached_frames``; the others are dropped once decoded) in what the limit
        leaves of it less the reserve (and, where frames are dropped, less what the bytes
        read ahead of their decode exceed the headroom by). Returns that room
        (``page_cache_room``). Nothing is pinned where frames are dropped, so every
        layer's frames are read each pass."""
        held = resident_bytes(frame_addresses(self.store))
        room = max(0, self.memory_limit - held - self._reserve)
        dropped: set[str] = set()
        if room < self._mapped_bytes():
            # The dropped frames read ahead: page cache, counted in the headroom first.
            room = max(0, room - max(0, self._read_ahead - self._headroom))
            encoded = self.store.encoded
            first: dict[int, str] = {}  # a tie's layers share their frames: one name each
            for n, e in encoded.items():
                first.setdefault(id(e), n)
            sizes = {n: encoded[n].file_backed_bytes for n in first.values()}
            kept = {id(encoded[n]) for n in choose_cached(sizes, room)}
            dropped = {n for n, e in encoded.items() if id(e) not in kept and e.file_backed_bytes}
        self._dropped = frozenset(dropped)
        self.cached_frames = frozenset(self.store.encoded) - self._dropped
        self.page_cache_room = room
        self._stream.read_ahead_bytes = self._read_ahead if dropped else 0
        self._stream.read_ahead_names = self._dropped
        return room

    @property
    def read_ahead_bytes(self) -> int:
        """Compressed bytes of dropped frames read ahead of their decode (0 where every
        frame stays cached)."""
        return self._stream.read_ahead_bytes

    def on_pass_start(self, index: int) -> None:
        if index == REPLAN_PASS and self._replan:
            # What the first pass left resident (the code it ran, the buffers it and the
            # model's other parts allocated) is measured now. Only a plan that dropped
            # frames at load is made again: where every frame fitted, the pinned set was
            # sized against that room, and measuring its buffers again less the headroom
            # (meant for code not run yet, which has run by now) would drop frames that
            # stay cached (SmolLM2 under 900 MiB: 22 MiB read a token, against 0.1).
            self._plan_page_cache()
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

    def pages_out(self, name: str) -> bool:
        return name in self._dropped

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
