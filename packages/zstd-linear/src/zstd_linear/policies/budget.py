"""Policy ``budget``: a fixed set of decoded weights pinned under a byte budget, the rest
streamed by per_pass_prefetch.

Every pass calls the layers in the same cyclic order, so LRU evicts exactly the layer
needed next and hits nothing below the total decoded size. For a cyclic sequence the
optimal cache keeps a fixed set: the pinned layers are decoded once and kept; every
other layer is decoded ahead and freed after use, as under per_pass_prefetch.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from zstd_linear.policies.base import BackingStore, CachePolicy
from zstd_linear.policies.prefetch import PerPassPrefetch

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


UNLIMITED = 1 << 62  # a cgroup v1 limit at or above this means none (the kernel writes ~2**63)


def _mounts(mountinfo: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(cgroup v1 memory mounts, cgroup v2 mounts), each as (root in the hierarchy, mount
    point), from the text of /proc/self/mountinfo."""
    v1, v2 = [], []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if not after:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if after[0] == "cgroup2":
            v2.append((root, point))
        elif after[0] == "cgroup" and "memory" in (after[-1].split(",") if len(after) > 2 else []):
            v1.append((root, point))
    return v1, v2


def _walk_limits(point: str, root: str, path: str, file: str) -> list[int]:
    """The limits written in ``file`` of the group at hierarchy ``path`` and of every
    group above it that the mount (of hierarchy ``root`` at ``point``) shows."""
    rel = path
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        rel = path[len(root) :]
    elif root != "/":
        rel = "/"  # a namespaced mount shows our group as its root
    parts = [p for p in rel.split("/") if p]
    limits = []
    for depth in range(len(parts), -1, -1):
        target = Path(point, *parts[:depth], file)
        try:
            text = target.read_text().strip()
        except OSError:
            continue
        if text != "max":
            try:
                value = int(text)
            except ValueError:
                continue
            if value < UNLIMITED:
                limits.append(value)
    return limits


def cgroup_memory_limit(proc: str | os.PathLike = "/proc/self") -> int | None:
    """The hard memory limit of the cgroups this process is in, in bytes: the smallest
    ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) of its group and the groups
    above it; None where no group sets one (or cgroups are not mounted)."""
    proc = Path(proc)
    try:
        groups = (proc / "cgroup").read_text()
        v1_mounts, v2_mounts = _mounts((proc / "mountinfo").read_text())
    except OSError:
        return None
    limits: list[int] = []
    for line in groups.splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":
            for root, point in v2_mounts:
                limits += _walk_limits(point, root, path, "memory.max")
        elif "memory" in controllers.split(","):
            for root, point in v1_mounts:
                limits += _walk_limits(point, root, path, "memory.limit_in_bytes")
    return min(limits) if limits else None


def physical_memory() -> int:
    """MemTotal of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal line")


def process_memory_limit() -> int:
    """What ``memory_limit="auto"`` stands for: the cgroup's hard limit
    (``cgroup_memory_limit``), or the machine's memory where there is none."""
    limit = cgroup_memory_limit()
    return min(limit, physical_memory()) if limit is not None else physical_memory()


def resident_bytes(skip: list[int] = ()) -> int:
    """What the process holds resident now and needs to go on: its anonymous pages and
    the pages of the files it maps (shared libraries' code and data above all, which a
    limit too tight for them makes the kernel read again and again), except the mappings
    that hold an address in ``skip`` (the compressed frames, counted apart). From the Rss
    of each mapping in /proc/self/smaps."""
    total = 0
    counted = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                file_backed = head[4] != "0"
                counted = not (file_backed and any(lo <= a < hi for a in skip))
            elif counted and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def frame_addresses(store: BackingStore) -> list[int]:
    """One address inside each distinct mapping the store's file-backed frames live in."""
    import numpy as np

    seen: dict[int, int] = {}
    for encoded in store.encoded.values():
        for chunk in encoded.frames:
            for frame in chunk:
                if frame.file_backed and len(frame.data):
                    base = id(frame.data.obj) if isinstance(frame.data, memoryview) else 0
                    if base not in seen:
                        seen[base] = np.frombuffer(frame.data, dtype=np.uint8).ctypes.data
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
                raise ValueError(f"{param} must be {kind}, got {value!r}")
        if (budget_bytes is None) == (memory_limit is None):
            raise ValueError(
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
        """Names of the pinned layers decoded so far, sorted."""
        return sorted(self._weights)

    def close(self) -> None:
        self._stream.close()
        for buf in self._buffers.values():
            self.store.pool.drop_dedicated(buf)
        self._buffers.clear()
        self._weights.clear()
