"""A dependency-free progress bar for compressing a whole model."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``[#####.....] 12/210 model.layers.3.mlp.up_proj 4.1s`` redrawn on one line."""

    def __init__(self, total: int, label: str = "compress", stream: TextIO | None = None):
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._start = time.perf_counter()
        self._draw("")  # at once: the first layer can take seconds to encode

    def advance(self, note: str = "") -> None:
        self.done += 1
        self._draw(note)

    def _draw(self, note: str) -> None:
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self._start
        self.stream.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} {note[:48]:<48} {elapsed:.1f}s"
        )
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()
