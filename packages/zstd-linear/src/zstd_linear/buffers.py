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

    Slabs all have ``slab_bytes`` (the largest compressed layer's weight), so any
    slab holds any layer and the pool never needs more slabs than weights alive at
    once. ``dedicated`` buffers are exact-size and owned by one layer (per_pass,
    resident). Every byte the pool holds counts in ``stats.decoded_bytes``.
    """

    def __init__(self, slab_bytes: int, stats: DecodeStats):
        self.slab_bytes = slab_bytes
        self.stats = stats
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def _grow(self, nbytes: int) -> None:
        self.stats.decoded_bytes += nbytes
        self.stats.peak_decoded_bytes = max(self.stats.peak_decoded_bytes, self.stats.decoded_bytes)

    def acquire_slab(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._grow(self.slab_bytes)
        return _empty(self.slab_bytes)

    def release_slab(self, slab: torch.Tensor) -> None:
        with self._lock:
            self._free.append(slab)

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
            self.stats.decoded_bytes -= self.slab_bytes * len(self._free)
            self._free.clear()
