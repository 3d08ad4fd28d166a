"""StreamingLLM: keep the anchors and the most recent tokens, nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.selectors.base import Pool, Selector


@dataclass(eq=False)
class StreamingSelector(Selector):
    """Fills the memory slots with the most recent candidates, so the kept set is the
    anchors (attention sinks) plus one recent window of B - B/n tokens: StreamingLLM at
    the same budget.

    Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
    https://arxiv.org/abs/2309.17453
    """

    name: ClassVar[str] = "streaming"

    def score(self, pool: Pool) -> torch.Tensor:
        return pool.positions.to(torch.float64)
