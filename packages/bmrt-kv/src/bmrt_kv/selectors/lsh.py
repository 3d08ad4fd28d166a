"""LSH frequency rank: score = how often a candidate shares a SimHash bucket with a query."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.errors import check_choice
from bmrt_kv.selectors.base import Pool, Selector
from bmrt_kv.selectors.simhash import MAX_BITS, SimHash, collision_counts
from bmrt_kv.selectors.tiebreak import TIE_BREAKERS, tiebreak_bonus

#: More tables than this only multiplies the hashing cost (and a typo such as 2**20 would
#: allocate gigabytes of hyperplanes mid-stream).
MAX_TABLES = 1024


@dataclass(eq=False)
class LSHSelector(Selector):
    """Ranks by collision count over L tables, ties broken by ``tie_breaker``.

    Args:
        tables: L hash tables, in [1, 1024].
        bits: K bits per table, in [1, 16].
        tie_breaker: one of :data:`bmrt_kv.selectors.tiebreak.TIE_BREAKERS`.
    """

    name: ClassVar[str] = "lsh"
    tables: int = 16
    bits: int = 6
    tie_breaker: str = "l2"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tables = self.option("tables", self.tables, 1, MAX_TABLES)
        self.bits = self.option("bits", self.bits, 1, MAX_BITS)
        where = f"selector {self.name!r} option 'tie_breaker'"
        self.tie_breaker = check_choice(where, self.tie_breaker, TIE_BREAKERS)
        self.hash = SimHash(self.tables, self.bits, self.seed)

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
