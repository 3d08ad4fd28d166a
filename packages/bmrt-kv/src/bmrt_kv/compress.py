"""One recursive compression step: State_t = Compress(State_{t-1} U Block_t)."""

from __future__ import annotations

import torch

from bmrt_kv.config import BMRTConfig
from bmrt_kv.selectors import Pool, Selector


def protected_mask(positions: torch.Tensor, seen: int, config: BMRTConfig) -> torch.Tensor:
    """Anchors (the first B/n positions of the stream) and the window (the last B/n).

    Args:
        positions: (b, h, P) int64 original positions.
        seen: tokens in the stream so far (the window is ``[seen - B/n, seen)``).

    Returns:
        (b, h, P) bool.
    """
    return (positions < config.n_anchor) | (positions >= seen - config.n_window)


def keep_indices(pool: Pool, seen: int, config: BMRTConfig, selector: Selector) -> torch.Tensor:
    """Indices of the ``config.budget`` pool tokens to keep, in pool (= position) order.

    The anchors and the window are kept; the selector fills the remaining slots from the
    candidates (the other tokens, old memory and new block alike), so an old token can
    be evicted by a more relevant new one or survive indefinitely.

    Args:
        pool: the layer's pool; ``pool.candidates`` must be ``~protected_mask(...)``.
        seen: tokens in the stream after this block.

    Returns:
        (b, h, budget) int64, sorted ascending.
    """
    protected = ~pool.candidates
    n_protected = protected.sum(dim=-1)
    if not bool((n_protected == n_protected.flatten()[0]).all()):
        raise RuntimeError("every head must protect the same number of tokens")
    k = config.budget - int(n_protected.flatten()[0])
    keep = protected.clone()
    if k > 0:
        chosen = selector.select(pool, k, shared=config.granularity == "layer")
        keep.scatter_(-1, chosen, True)
    # A stable sort of "not kept" puts the kept tokens first, still in pool order.
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
    return order[..., : config.budget]
