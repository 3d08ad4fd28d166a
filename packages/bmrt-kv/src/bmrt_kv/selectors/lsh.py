"""LSH frequency rank: score = how often a candidate shares a SimHash bucket with a query."""

from __future__ import annotations

import torch

from bmrt_kv.selectors.base import Pool, Selector
from bmrt_kv.selectors.simhash import SimHash, collision_counts
from bmrt_kv.selectors.tiebreak import TIE_BREAKERS, tiebreak_bonus


class LSHSelector(Selector):
    """Ranks by collision count over L tables, ties broken by ``tie_breaker``.

    Args:
        tables: L hash tables.
        bits: K bits per table.
        tie_breaker: one of :data:`bmrt_kv.selectors.tiebreak.TIE_BREAKERS`.
    """

    def __init__(
        self, seed: int = 0, tables: int = 16, bits: int = 6, tie_breaker: str = "l2"
    ) -> None:
        super().__init__(seed)
        if tie_breaker not in TIE_BREAKERS:
            raise ValueError(
                f"tie_breaker must be one of {sorted(TIE_BREAKERS)}, got {tie_breaker!r}"
            )
        self.hash = SimHash(tables, bits, seed)
        self.tie_breaker = tie_breaker

    def score(self, pool: Pool) -> torch.Tensor:
        query_codes = self.hash.codes(pool.queries)  # (b, h, Q, L)
        key_codes = self.hash.codes(pool.keys)  # (b, h, P, L)
        counts = collision_counts(query_codes, key_codes, self.hash.bits, pool.query_weights)
        counts = counts.to(torch.float64)
        if self.tie_breaker == "none":
            return counts
        distance = TIE_BREAKERS[self.tie_breaker](pool.keys, pool.queries)
        # Only candidates compete; pushing the others to +inf keeps their ranks from
        # shifting the candidates' bonuses.
        distance = distance.masked_fill(~pool.candidates, float("inf"))
        return counts + tiebreak_bonus(distance)
