"""H2O (heavy-hitter oracle): rank by attention accumulated over every query seen so far."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.errors import BMRTError
from bmrt_kv.selectors.base import Pool, Selector


@dataclass(eq=False)
class H2OSelector(Selector):
    """Keeps the tokens with the largest attention mass summed over all past queries.

    The cache adds each step's attention mass to ``Pool.accumulated`` before selecting
    (``stateful``), so a token's score is everything it received since it arrived.

    Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
    Large Language Models", https://arxiv.org/abs/2306.14048
    """

    name: ClassVar[str] = "h2o"
    stateful: ClassVar[bool] = True

    def score(self, pool: Pool) -> torch.Tensor:
        if pool.accumulated is None:
            raise BMRTError("the h2o selector needs Pool.accumulated (got None)")
        return pool.accumulated.to(torch.float64)
