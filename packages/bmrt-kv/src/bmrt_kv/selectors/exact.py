"""Exact attention scoring: relevance = sum over the block's queries of softmax(Q K^T)."""

from __future__ import annotations

import torch

from bmrt_kv.selectors.attention import MAX_KERNEL, attention_mass, max_pool_over_time
from bmrt_kv.selectors.base import Pool, Selector


class ExactSelector(Selector):
    """The quality upper bound: the attention mass each candidate receives from the block.

    Args:
        kernel: odd width of a max-pool over neighbouring positions applied to the scores
            (1, the default, is the design: no pooling). A wider kernel keeps the tokens
            around a hit too, so a number split into one token per digit is kept whole.
    """

    name = "exact"

    def __init__(self, seed: int = 0, kernel: int = 1) -> None:
        super().__init__(seed)
        self.kernel = self.option("kernel", kernel, 1, MAX_KERNEL, odd=True)

    def score(self, pool: Pool) -> torch.Tensor:
        return max_pool_over_time(attention_mass(pool), self.kernel).to(torch.float64)
