"""Reusable decode buffers and the accounting of decoded-weight memory."""

from __future__ import annotations

import threading

import torch

from zstd_linear.stats import DecodeStats


def _empty(nbytes: int) -> torch.Tensor:
    # A normal tensor even when first needed under inference_mode, so that it can be
    # refilled and used after inference_mode exits.
    with torch.inference_mode(False):
        return torch.empty(nbytes, dtype=torch.uint8)


class BufferPool:
    """Hands out uint8 CPU buffers and takes them back for reuse.

    Slabs have ``slab_bytes`` (the largest Linear weight), so any slab holds any
    Linear and the pool never needs more slabs than weights alive at once. A weight
    larger than that (an lm_head tied to a compressed embedding) gets a slab of its
    own size, kept for reuse by weights of that size. ``dedicated`` buffers are
    exact-size and owned by one layer (per_pass, resident). Every byte the pool holds
    counts in ``stats.decoded_bytes``.
    """

    def __init__(self, slab_bytes: int, stats: DecodeStats):
        self.slab_bytes = slab_bytes
        self.stats = stats
        self._free: dict[int, list[torch.Tensor]] = {}  # slab bytes -> free slabs
        self._lock = threading.Lock()

    def _grow(self, nbytes: int) -> None:
        self.stats.decoded_bytes += nbytes
        self.stats.peak_decoded_bytes = max(self.stats.peak_decoded_bytes, self.stats.decoded_bytes)

    def acquire_slab(self, nbytes: int = 0) -> torch.Tensor:
        """A slab of at least ``nbytes`` (``slab_bytes`` unless ``nbytes`` is larger)."""
        size = max(nbytes, self.slab_bytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            self._grow(size)
        return _empty(size)

    def release_slab(self, slab: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(slab.numel(), []).append(slab)

    def dedicated(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            self._grow(nbytes)
        return _empty(nbytes)

    def drop_dedicated(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.stats.decoded_bytes -= buf.numel()

    def trim(self) -> None:
        """Free the slabs no weight uses (after a policy change)."""
        with self._lock:
            self.stats.decoded_bytes -= sum(n * len(free) for n, free in self._free.items())
            self._free.clear()
