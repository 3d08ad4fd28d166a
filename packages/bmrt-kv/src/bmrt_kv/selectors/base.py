"""The selector interface: rank a layer's candidate tokens by relevance to the current queries."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.errors import BMRTError, check_int

#: Largest selector seed: a torch generator seed, with room for hybrid's second stage.
MAX_SELECTOR_SEED = 2**63 - 2


@dataclass
class Pool:
    """One layer's tokens at a compression step: what it kept plus the new block.

    ``h`` is the number of KV heads; the ``G`` query heads sharing a KV head contribute
    their queries to that head's group, so ``Q = G * T`` for a block of ``T`` tokens.

    Attributes:
        keys: (b, h, P, hd) float, rotated keys of the pool, sorted by position per head.
        positions: (b, h, P) int64, original (absolute) position of each pool token.
        queries: (b, h, Q, hd) float, rotated scoring queries grouped per KV head, laid
            out as ``query_groups`` query heads of ``Q // query_groups`` tokens each.
        query_positions: (Q,) int64, position of each scoring query (for causal masks).
        query_groups: G, the query heads per KV head.
        candidates: (b, h, P) bool, True where a token may be selected (not anchor/window).
        accumulated: (b, h, P) float or None, attention each token received so far (H2O).
        query_weights: (Q,) float or None, how much each scoring query counts (None: 1
            each). Query-aware scoring gives the question as much weight as the block.
        n_question: the question's queries per query head (query-aware scoring: the last
            ``n_question`` of each head's ``Q // query_groups``); 0 without a question.
        key_sum: (b, h, hd) float32 or None, the sum of the unit-normalised keys of every
            token the layer has seen, the new block included (only for a selector whose
            :meth:`Selector.needs_key_sum` is True).
    """

    keys: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    query_positions: torch.Tensor
    candidates: torch.Tensor
    query_groups: int = 1
    accumulated: torch.Tensor | None = None
    query_weights: torch.Tensor | None = None
    n_question: int = 0
    key_sum: torch.Tensor | None = None


@dataclass(eq=False)
class Selector(ABC):
    """Ranks candidates; :meth:`select` returns exactly ``k`` distinct candidate indices.

    Subclasses implement :meth:`score` (higher is more relevant). Ties keep pool order
    (older first) because the ranking uses a stable sort, so selection is deterministic.

    A selector's options are dataclass fields, checked in ``__post_init__`` (as kvpress's
    presses are): a bad value raises :class:`~bmrt_kv.BMRTError` naming the selector and
    the option when the config is built, never mid-stream.

    Attributes:
        seed: Seeds its random projections; :class:`~bmrt_kv.BMRTConfig` sets it per layer.
    """

    seed: int = 0

    #: True when the selector needs ``Pool.accumulated`` kept up to date across steps.
    stateful: ClassVar[bool] = False
    #: The name it is registered under in :data:`bmrt_kv.SELECTORS` (used in errors).
    name: ClassVar[str] = "selector"

    def __post_init__(self) -> None:
        self.seed = check_int(
            f"the seed of selector {self.name!r}", self.seed, 0, MAX_SELECTOR_SEED
        )

    @property
    def needs_key_sum(self) -> bool:
        """True when the layer must keep ``Pool.key_sum`` (a running sum over the stream)."""
        return False

    def option(self, option: str, value, low: int, high: int, odd: bool = False) -> int:
        """Check an int option of this selector.

        Args:
            option: the option's name, for the error.
            value: the value given.
            low: the smallest allowed value.
            high: the largest allowed value.
            odd: whether the value must be odd.

        Returns:
            ``value``.

        Raises:
            BMRTError: naming the selector and the option, for a value out of range.
        """
        return check_int(f"selector {self.name!r} option {option!r}", value, low, high, odd)

    @abstractmethod
    def score(self, pool: Pool) -> torch.Tensor:
        """Relevance of every pool token.

        Args:
            pool: the layer's pool.

        Returns:
            (b, h, P) float64 scores, higher is more relevant (non-candidates are ignored).
        """

    def select(
        self, pool: Pool, k: int, shared: bool = False, exclude: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pick ``k`` candidates per (batch, head).

        Args:
            pool: the layer's pool.
            k: how many to pick; every (batch, head) must have at least ``k`` eligible tokens.
            shared: one index for all heads (scores summed over heads).
            exclude: (b, h, P) bool, tokens already taken (hybrid's second stage).

        Returns:
            (b, h, k) int64 indices into the pool's P axis, distinct within each row.
        """
        scores = self.score(pool).to(torch.float64)
        eligible = pool.candidates if exclude is None else pool.candidates & ~exclude
        return top_k(scores, eligible, k, shared)


def top_k(scores: torch.Tensor, eligible: torch.Tensor, k: int, shared: bool) -> torch.Tensor:
    """Stable top-``k``: ties keep pool order.

    Args:
        scores: (b, h, P) float.
        eligible: (b, h, P) bool, the tokens that may be picked.
        k: how many to pick.
        shared: one index for all heads (scores summed over heads).

    Returns:
        (b, h, k) int64 indices into P.

    Raises:
        BMRTError: fewer than ``k`` eligible tokens in some row.
    """
    b, h, _ = scores.shape
    if shared:
        # Shared index: the heads agree on one token set, so rank by the summed relevance.
        scores = scores.sum(dim=1, keepdim=True)
        eligible = eligible.all(dim=1, keepdim=True)
    available = int(eligible.sum(dim=-1).min())
    if available < k:
        raise BMRTError(f"k={k} exceeds the {available} eligible candidates")
    scores = scores.masked_fill(~eligible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    picked = order[..., :k]
    return picked.expand(b, h, k) if shared else picked
