"""Remasking strategies of the SDAR reference: which masked tokens a step commits to.

Each strategy sees one block: ``mask_index`` (bs,) bool (still masked), ``confidence``
(bs,) float (probability of each sampled token) and ``k``, the schedule's count for this
step, and returns a (bs,) bool of positions to unmask, always a non-empty subset of
``mask_index``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


def num_transfer_tokens(block_size: int, steps: int) -> list[int]:
    """How many tokens each of ``steps`` steps unmasks: block_size/steps, remainder first."""
    if not 1 <= steps <= block_size:
        raise ValueError(f"steps must be in [1, {block_size}] (block_size), got {steps}")
    base, rem = divmod(block_size, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


class Remasking(ABC):
    name: str

    @abstractmethod
    def select(self, mask_index: torch.Tensor, confidence: torch.Tensor, k: int) -> torch.Tensor:
        """mask_index: (bs,) bool; confidence: (bs,) float -> transfer (bs,) bool."""


def _top_k(mask_index: torch.Tensor, confidence: torch.Tensor, k: int) -> torch.Tensor:
    conf = torch.where(mask_index, confidence, -torch.inf)
    k = min(k, int(mask_index.sum()))
    transfer = torch.zeros_like(mask_index)
    transfer[torch.topk(conf, k).indices] = True
    return transfer


class Sequential(Remasking):
    """Unmask the first ``k`` still-masked positions, left to right."""

    name = "sequential"

    def select(self, mask_index, confidence, k):
        first = int(mask_index.nonzero()[0, 0])
        transfer = torch.zeros_like(mask_index)
        transfer[first : first + k] = True
        return transfer & mask_index


class LowConfidenceStatic(Remasking):
    """Unmask the ``k`` most confident masked positions (block_size/steps per step)."""

    name = "low_confidence_static"

    def select(self, mask_index, confidence, k):
        return _top_k(mask_index, confidence, k)


class LowConfidenceDynamic(Remasking):
    """Unmask every masked position above ``threshold`` if there are at least ``k`` of them,
    else the ``k`` most confident (with steps == block_size, k is 1: the single best)."""

    name = "low_confidence_dynamic"

    def __init__(self, threshold: float = 0.9) -> None:
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def select(self, mask_index, confidence, k):
        high = mask_index & (confidence > self.threshold)
        if int(high.sum()) >= k:
            return high
        return _top_k(mask_index, confidence, k)


REMASKING: dict[str, type[Remasking]] = {
    cls.name: cls for cls in (Sequential, LowConfidenceStatic, LowConfidenceDynamic)
}


def make_remasking(name: str, threshold: float = 0.9) -> Remasking:
    if name not in REMASKING:
        raise ValueError(f"remasking must be one of {sorted(REMASKING)}, got {name!r}")
    if name == LowConfidenceDynamic.name:
        return LowConfidenceDynamic(threshold)
    return REMASKING[name]()
