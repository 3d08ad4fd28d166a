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

    The full (b, h, Q, P) matrix: for inspection and tests; the selectors score through
    :func:`attention_mass`, which never holds it.

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
    when given (and all queries are used): (b, h, P) float32.

    Computed over chunks of ``head_dim`` queries (all KV heads at once), so the scoring
    workspace is a few (b, h, head_dim, P) matrices, about the size of the pool's keys,
    whatever the block length: never the (b, h, Q, P) matrix of every query at once,
    which for a 512-token block of SmolLM2 is 24 times the pool's keys.
    """
    queries, query_positions = pool.queries, pool.query_positions
    weights = pool.query_weights if last_queries is None else None
    if last_queries is not None:
        queries, query_positions = _tail_per_head(pool, last_queries)
    n_queries, head_dim = queries.shape[-2:]
    keys_t = pool.keys.float().transpose(-1, -2)  # (b, h, hd, P)
    positions = pool.positions.unsqueeze(-2)  # (b, h, 1, P)
    scale = 1.0 / math.sqrt(head_dim)
    mass = torch.zeros(pool.keys.shape[:-1], dtype=torch.float32, device=pool.keys.device)
    for start in range(0, n_queries, head_dim):
        stop = min(start + head_dim, n_queries)
        logits = torch.matmul(queries[:, :, start:stop].float(), keys_t)  # (b, h, C, P)
        logits.mul_(scale)
        hidden = positions > query_positions[start:stop].view(1, 1, -1, 1)  # (b, h, C, P)
        logits.masked_fill_(hidden, float("-inf"))
        del hidden
        probs = torch.softmax(logits, dim=-1)
        del logits
        if weights is None:
            mass += probs.sum(dim=-2)
        else:
            mass += torch.einsum("bhqp,q->bhp", probs, weights[start:stop].to(probs.dtype))
    return mass


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
