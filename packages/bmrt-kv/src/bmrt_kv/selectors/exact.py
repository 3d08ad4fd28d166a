"""Exact attention scoring: relevance = sum over the block's queries of softmax(Q K^T)."""

from __future__ import annotations

import torch

from bmrt_kv.selectors.attention import attention_mass
from bmrt_kv.selectors.base import Pool, Selector


class ExactSelector(Selector):
    """The quality upper bound: the attention mass each candidate receives from the block."""

    def score(self, pool: Pool) -> torch.Tensor:
        return attention_mass(pool).to(torch.float64)
