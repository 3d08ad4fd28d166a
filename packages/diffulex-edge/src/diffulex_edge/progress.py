"""A dependency-free progress bar over the named stages of a long job (an export)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class StageProgress:
    """``with bar.stage("lowering"):`` prints ``[####------] 2/5 lowering`` to ``stream`` when
    the stage starts and the elapsed seconds when it ends; ``enabled=False`` prints nothing."""

    WIDTH = 20

    def __init__(self, total: int, enabled: bool = True, stream=None) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()

    def _bar(self) -> str:
        filled = self.WIDTH * self.done // max(self.total, 1)
        return "[" + "#" * filled + "-" * (self.WIDTH - filled) + "]"

    @contextmanager
    def stage(self, name: str):
        if self.enabled:
            print(f"{self._bar()} {self.done + 1}/{self.total} {name} ...", file=self.stream)
        t0 = time.perf_counter()
        yield
        self.done += 1
        if self.enabled:
            print(
                f"{self._bar()} {self.done}/{self.total} {name} done in "
                f"{time.perf_counter() - t0:.1f} s (total {time.perf_counter() - self.start:.1f} s)",
                file=self.stream,
                flush=True,
            )
