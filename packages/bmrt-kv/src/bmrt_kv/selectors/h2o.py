"""H2O (heavy-hitter oracle): rank by attention accumulated over every query seen so far."""

from __future__ import annotations

import torch

from bmrt_kv.errors import BMRTError
from bmrt_kv.selectors.base import Pool, Selector


class H2OSelector(Selector):
    """Keeps the tokens with the largest attention mass summed over all past queries.

    The cache adds each step's attention mass to ``Pool.accumulated`` before selecting
    (``stateful``), so a token's score is everything it received since it arrived.
    """

    name = "h2o"
    stateful = True

    def score(self, pool: Pool) -> torch.Tensor:
        if pool.accumulated is None:
            raise BMRTError("the h2o selector needs Pool.accumulated (got None)")
        return pool.accumulated.to(torch.float64)
