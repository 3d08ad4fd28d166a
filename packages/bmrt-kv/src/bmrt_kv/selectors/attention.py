"""Attention mass received by each pool token: the accumulator behind exact, h2o and snapkv."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bmrt_kv.selectors.base import Pool

#: Widest max-pool kernel: its cost is P * kernel per head, and a kernel wider than the
#: pool smooths every score into one.
MAX_KERNEL = 1023


def attention_probs(pool: Pool, last_queries: int | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(hd)) of the scoring queries over the whole pool, causally masked.

    A query at position p sees the pool tokens at positions <= p, as in the forward pass,
    so the softmax includes anchors and window (they absorb mass just as in the model).

    Args:
        pool: the layer's pool.
        last_queries: use only the last this-many queries per query head (SnapKV's
            observation window); ``None`` uses all.

    Returns:
        (b, h, Q', P) float32 attention probabilities.
    """
    queries, query_positions = pool.queries, pool.query_positions
    if last_queries is not None:
        queries, query_positions = _tail_per_head(pool, last_queries)
    head_dim = pool.keys.shape[-1]
    logits = torch.matmul(queries.float(), pool.keys.float().transpose(-1, -2))  # (b, h, Q, P)
    logits = logits / math.sqrt(head_dim)
    visible = pool.positions.unsqueeze(-2) <= query_positions.view(1, 1, -1, 1)  # (b, h, Q, P)
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1)


def attention_mass(pool: Pool, last_queries: int | None = None) -> torch.Tensor:
    """Sum over queries of :func:`attention_probs`, weighted by ``pool.query_weights``
    when given (and all queries are used): (b, h, P) float32."""
    probs = attention_probs(pool, last_queries)
    if pool.query_weights is None or last_queries is not None:
        return probs.sum(dim=-2)
    return torch.einsum("bhqp,q->bhp", probs, pool.query_weights.to(probs.dtype))


def max_pool_over_time(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool (b, h, P) scores over ``kernel`` neighbouring pool tokens (odd; 1: as is).

    The pool is sorted by position per head, so neighbours along P are neighbours in time.
    """
    if kernel == 1:
        return scores
    b, h, p = scores.shape
    pooled = F.max_pool1d(scores.reshape(b * h, 1, p), kernel, stride=1, padding=kernel // 2)
    return pooled.view(b, h, p)


def _tail_per_head(pool: Pool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The window is the last n tokens of each query head, so the (G * T) group is split
    # back into its G heads before slicing.
    b, h, q, hd = pool.queries.shape
    groups = pool.query_groups
    t = q // groups
    take = min(n, t)
    tail = pool.queries.view(b, h, groups, t, hd)[:, :, :, t - take :, :].reshape(b, h, -1, hd)
    return tail, pool.query_positions.view(groups, t)[:, t - take :].reshape(-1)
