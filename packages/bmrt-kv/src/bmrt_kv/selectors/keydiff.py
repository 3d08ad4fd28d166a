"""KeyDiff: keep the keys least similar to the pool's mean key (no queries involved)."""

from __future__ import annotations

import torch

from bmrt_kv.selectors.base import Pool, Selector


class KeyDiffSelector(Selector):
    """Scores a candidate by minus the cosine similarity of its key to the mean candidate key
    of its head (KeyDiff, Park et al. 2025).

    Repetitive context (boilerplate, filler, logs) yields keys close to the mean; rare
    content stands out and is kept. It ignores the queries, so it is query-agnostic
    whatever the scoring mode, and it is cheap: one mean and one cosine per token.
    """

    name = "keydiff"

    def score(self, pool: Pool) -> torch.Tensor:
        keys = torch.nn.functional.normalize(pool.keys.to(torch.float32), dim=-1)
        weight = pool.candidates.unsqueeze(-1).to(keys.dtype)  # (b, h, P, 1)
        mean = (keys * weight).sum(-2, keepdim=True) / weight.sum(-2, keepdim=True).clamp(min=1)
        cosine = torch.nn.functional.cosine_similarity(keys, mean, dim=-1, eps=1e-12)
        return (-cosine).to(torch.float64)
