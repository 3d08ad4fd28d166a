"""Exact attention scoring: relevance = sum over the block's queries of softmax(Q K^T)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.selectors.attention import MAX_KERNEL, attention_mass, max_pool_over_time
from bmrt_kv.selectors.base import Pool, Selector


@dataclass(eq=False)
class ExactSelector(Selector):
    """The quality upper bound: the attention mass each candidate receives from the block.

    Args:
        kernel: odd width of a max-pool over neighbouring positions applied to the scores
            (1, the default, is the design: no pooling). A wider kernel keeps the tokens
            around a hit too, so a number split into one token per digit is kept whole.
    """

    name: ClassVar[str] = "exact"
    kernel: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.kernel = self.option("kernel", self.kernel, 1, MAX_KERNEL, odd=True)

    def score(self, pool: Pool) -> torch.Tensor:
        return max_pool_over_time(attention_mass(pool), self.kernel).to(torch.float64)
