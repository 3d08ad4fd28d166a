"""Policy ``per_pass_prefetch``: decode ahead in the observed order, free after last use.

The first pass (and any pass after the call order changed) decodes on demand, like
``none``, while it records the sequence of layer calls. From then on a background
thread decodes layers in first-use order, cyclically (the end of one pass prefetches
the start of the next), keeping at most ``window`` weights decoded or decoding; each
weight is freed right after its last call in the pass. A pass whose calls leave the
recorded sequence drains the window, finishes on demand, and is recorded afresh.

With ``read_ahead_bytes``, the compressed frames of the layers after those decoding are
asked from their file ahead (``BackingStore.will_need``), up to that many bytes past the
last layer handed to the thread: where frames are read from storage at every pass (under
a hard memory limit, ``Budget``), the device then reads the next layers while this one
decodes and the model computes, instead of idling until the next decode faults its
frames in one after another.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zstd_linear.errors import ZstdLinearError
from zstd_linear.policies.base import BackingStore, CachePolicy


class PerPassPrefetch(CachePolicy):
    """window: int >= 1, the most weights decoded (or decoding) at once, including the
    one in use; 2 overlaps one decode with one layer's compute. read_ahead_bytes: int >=
    0, compressed bytes of file-backed frames asked from storage ahead of the window (0:
    none; see the module's docstring); each layer is asked once a pass, in the recorded
    order, the next one only once the bytes asked but not yet handed to the decode thread
    leave room for it."""

    name = "per_pass_prefetch"

    def __init__(self, store: BackingStore, window: int = 2, read_ahead_bytes: int = 0):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ZstdLinearError(f"window must be an int >= 1, got {window!r}")
        check_read_ahead(read_ahead_bytes)
        super().__init__(store)
        self.window = window
        self.read_ahead_bytes = read_ahead_bytes
        #: the layers read ahead (None: every layer with file-backed frames; ``Budget``
        #: names the ones whose frames it does not keep cached)
        self.read_ahead_names: frozenset[str] | None = None
        # Read-ahead positions count layers handed out since the sequence was adopted
        # (position p is _order[p % len(_order)]): _handed layers went to the thread,
        # _asked were asked from storage, _ahead holds (position, bytes) of those asked
        # and not yet handed.
        self._handed = self._asked = self._ahead_bytes = 0
        self._ahead: deque[tuple[int, int]] = deque()
        self._sequence: list[str] | None = None  # layer calls of one pass, in order
        self._last_use: list[bool] = []  # per call: the layer's last call in the pass
        self._order: list[str] = []  # layers by first use
        self._recording: list[str] = []
        self._recording_valid = True
        self._call = 0
        self._next = 0  # index into _order of the next layer to prefetch
        self._pending: OrderedDict[str, Future] = OrderedDict()
        self._live: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (slab, weight)
        self._on_demand: dict[str, torch.Tensor] = {}  # name -> slab, outside the sequence
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="zstd-linear-prefetch")

    @property
    def sequence(self) -> list[str] | None:
        """The recorded call order (fully qualified names), or None while recording."""
        return None if self._sequence is None else list(self._sequence)

    def on_pass_start(self, index: int) -> None:
        if self._sequence is None:
            if self._recording and self._recording_valid:
                self._adopt(self._recording)
        elif self._call != len(self._sequence):
            self._forget()  # the last pass stopped early or diverged
        self._recording = []
        self._recording_valid = True
        self._call = 0
        if self._sequence is not None:
            self._fill()

    def _adopt(self, sequence: list[str]) -> None:
        self._sequence = list(sequence)
        last: dict[str, int] = {}
        for i, name in enumerate(sequence):
            last[name] = i
        self._last_use = [last[name] == i for i, name in enumerate(sequence)]
        self._order = list(dict.fromkeys(sequence))
        self._next = 0
        self._handed = self._asked = self._ahead_bytes = 0
        self._ahead.clear()

    def _forget(self) -> None:
        self._drain()
        self._sequence = None

    def _drain(self) -> None:
        for future in self._pending.values():
            slab, _ = future.result()
            self.store.pool.release_slab(slab)
        self._pending.clear()
        for slab, _ in self._live.values():
            self.store.pool.release_slab(slab)
        self._live.clear()

    def _decode(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        slab = self.store.pool.acquire_slab(self.store.nbytes(name))
        try:
            return slab, self.store.decode(name, slab)
        except BaseException:
            self.store.pool.release_slab(slab)
            raise

    def _fill(self) -> None:
        while len(self._pending) + len(self._live) < self.window:
            name = self._order[self._next]
            if name in self._pending or name in self._live:
                return  # window wider than the model: everything is already there
            self._pending[name] = self._executor.submit(self._decode, name)
            self._next = (self._next + 1) % len(self._order)
            self._handed += 1
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Ask for the frames of the layers after the last one handed out, in the
        recorded order, while they fit ``read_ahead_bytes`` with those asked before."""
        if not self.read_ahead_bytes:
            return
        while self._ahead and self._ahead[0][0] < self._handed:
            self._ahead_bytes -= self._ahead.popleft()[1]
        self._asked = max(self._asked, self._handed)
        n, only = len(self._order), self.read_ahead_names
        while self._asked < self._handed + n:  # at most one pass ahead
            name = self._order[self._asked % n]
            size = self.store.encoded[name].file_backed_bytes
            size = size if only is None or name in only else 0
            if size and self._ahead_bytes + size > self.read_ahead_bytes:
                return
            if size:
                self.store.will_need(name)
                self._ahead.append((self._asked, size))
                self._ahead_bytes += size
            self._asked += 1

    def acquire(self, name: str) -> torch.Tensor:
        if self._sequence is None:
            if self._recording_valid:
                self._recording.append(name)
            return self._decode_on_demand(name)
        if self._call >= len(self._sequence) or self._sequence[self._call] != name:
            self._forget()
            self._recording_valid = False  # recorded from mid-pass: not a whole pass
            return self._decode_on_demand(name)
        if name not in self._live:
            future = self._pending.pop(name, None)
            if future is None:  # the window is full of layers still awaiting a later call
                self._live[name] = self._decode(name)
            else:
                start = time.perf_counter()
                self._live[name] = future.result()
                self.store.record_wait(time.perf_counter() - start)
        return self._live[name][1]

    def _decode_on_demand(self, name: str) -> torch.Tensor:
        slab, weight = self._decode(name)
        self._on_demand[name] = slab
        return weight

    def release(self, name: str) -> None:
        slab = self._on_demand.pop(name, None)
        if slab is not None:
            self.store.pool.release_slab(slab)
            return
        last = self._last_use[self._call]
        self._call += 1
        if last:
            slab, _ = self._live.pop(name)
            self.store.pool.release_slab(slab)
            self._fill()

    def close(self) -> None:
        self._drain()
        for slab in self._on_demand.values():
            self.store.pool.release_slab(slab)
        self._on_demand.clear()
        self._executor.shutdown(wait=True)


def check_read_ahead(read_ahead_bytes) -> None:
    """ZstdLinearError unless ``read_ahead_bytes`` is an int >= 0."""
    if (
        isinstance(read_ahead_bytes, bool)
        or not isinstance(read_ahead_bytes, int)
        or read_ahead_bytes < 0
    ):
        raise ZstdLinearError(f"read_ahead_bytes must be an int >= 0, got {read_ahead_bytes!r}")
