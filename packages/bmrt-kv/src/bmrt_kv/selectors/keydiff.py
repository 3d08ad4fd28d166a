"""KeyDiff: keep the keys least similar to the pool's mean key (no queries involved)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.selectors.base import Pool, Selector


@dataclass(eq=False)
class KeyDiffSelector(Selector):
    """Scores a candidate by minus the cosine similarity of its key to the mean candidate key
    of its head (KeyDiff, Park et al. 2025).

    Repetitive context (boilerplate, filler, logs) yields keys close to the mean; rare
    content stands out and is kept. It ignores the queries, so it is query-agnostic
    whatever the scoring mode, and it is cheap: one mean and one cosine per token.

    Paper: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
    LLM Inference in Resource-Constrained Environments", https://arxiv.org/abs/2504.15364
    """

    name: ClassVar[str] = "keydiff"

    def score(self, pool: Pool) -> torch.Tensor:
        keys = torch.nn.functional.normalize(pool.keys.to(torch.float32), dim=-1)  # (b,h,P,hd)
        weight = pool.candidates.to(keys.dtype)  # (b, h, P)
        # The candidates' mean key, as a weighted sum: (b, h, 1, hd) without a weighted copy
        # of every key.
        mean = torch.matmul(weight.unsqueeze(-2), keys)
        mean = mean / weight.sum(-1).clamp(min=1).view(*weight.shape[:2], 1, 1)
        mean = torch.nn.functional.normalize(mean, dim=-1, eps=1e-12)
        cosine = torch.matmul(keys, mean.transpose(-1, -2)).squeeze(-1)  # (b, h, P)
        return (-cosine).to(torch.float64)
