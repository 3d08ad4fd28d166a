"""SnapKV: attention from an observation window of the last queries, smoothed by pooling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.errors import MAX_TOKENS
from bmrt_kv.selectors.attention import MAX_KERNEL, attention_mass, max_pool_over_time
from bmrt_kv.selectors.base import Pool, Selector


@dataclass(eq=False)
class SnapKVSelector(Selector):
    """Scores = attention mass from the last ``window`` queries of each head, max-pooled.

    Pooling over neighbouring positions keeps the context around a hit (a number and the
    words next to it) instead of isolated tokens, as in the SnapKV paper.

    Paper: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
    https://arxiv.org/abs/2404.14469

    Args:
        window: observation-window length in tokens (>= 1).
        kernel: pooling kernel size, odd, in [1, 1023].
    """

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        self.window = self.option("window", self.window, 1, MAX_TOKENS)
        self.kernel = self.option("kernel", self.kernel, 1, MAX_KERNEL, odd=True)

    def score(self, pool: Pool) -> torch.Tensor:
        mass = attention_mass(pool, last_queries=self.window)  # (b, h, P)
        return max_pool_over_time(mass, self.kernel).to(torch.float64)
