"""Tie-breakers for LSH frequency rank: a distance from each candidate to the queries."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Each function maps keys (b, h, P, hd) and queries (b, h, Q, hd) to a distance
# (b, h, P) float; a smaller distance wins a tie in collision count.
TieBreaker = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_EPS = 1e-6


def l2_to_mean(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Euclidean distance to the mean query: O(P * hd).

    Args:
        keys: (b, h, P, hd) float, the candidates' rotated keys.
        queries: (b, h, Q, hd) float, the scoring queries.

    Returns:
        (b, h, P) float distances; a smaller one wins a tie.
    """
    mean = queries.float().mean(dim=-2, keepdim=True)  # (b, h, 1, hd)
    return (keys.float() - mean).norm(dim=-1)


def max_sim(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Distance to the nearest query: O(Q * P * hd).

    Args:
        keys: (b, h, P, hd) float, the candidates' rotated keys.
        queries: (b, h, Q, hd) float, the scoring queries.

    Returns:
        (b, h, P) float distances; a smaller one wins a tie.
    """
    return torch.cdist(keys.float(), queries.float()).amin(dim=-1)


def mahalanobis(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Diagonal Mahalanobis distance to the query distribution (variance-weighted l2).

    Args:
        keys: (b, h, P, hd) float, the candidates' rotated keys.
        queries: (b, h, Q, hd) float, the scoring queries.

    Returns:
        (b, h, P) float distances; a smaller one wins a tie.
    """
    q = queries.float()
    mean = q.mean(dim=-2, keepdim=True)
    # Population variance (a single query has zero variance); eps guards flat dimensions.
    var = q.var(dim=-2, unbiased=False, keepdim=True) + _EPS
    return ((keys.float() - mean) ** 2 / var).sum(dim=-1).sqrt()


def partitioned_centroid(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """Distance to the nearest of k contiguous query-chunk centroids, k = max(1, Q // 16) <= 8.

    Args:
        keys: (b, h, P, hd) float, the candidates' rotated keys.
        queries: (b, h, Q, hd) float, the scoring queries.

    Returns:
        (b, h, P) float distances; a smaller one wins a tie.
    """
    q = queries.float()
    n_queries = q.shape[-2]
    k = min(8, max(1, n_queries // 16))
    centroids = torch.stack([c.mean(dim=-2) for c in q.tensor_split(k, dim=-2)], dim=-2)
    return torch.cdist(keys.float(), centroids).amin(dim=-1)


def no_tiebreak(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """All equal: ties keep pool order (the stable sort), older tokens first.

    Args:
        keys: (b, h, P, hd) float, the candidates' rotated keys.
        queries: (b, h, Q, hd) float, the scoring queries.

    Returns:
        (b, h, P) float distances; a smaller one wins a tie.
    """
    return torch.zeros(keys.shape[:-1], device=keys.device)


TIE_BREAKERS: dict[str, TieBreaker] = {
    "l2": l2_to_mean,
    "max_sim": max_sim,
    "mahalanobis": mahalanobis,
    "partitioned_centroid": partitioned_centroid,
    "none": no_tiebreak,
}


def tiebreak_bonus(distance: torch.Tensor) -> torch.Tensor:
    """Map distances to a bonus in (0, 1), higher for nearer, by rank.

    Adding it to an integer collision count gives a score whose order is exactly
    (count descending, distance ascending); equal distances keep pool order.

    Args:
        distance: (b, h, P) float, a tie-breaker's distances.

    Returns:
        (b, h, P) float64 bonuses.
    """
    p = distance.shape[-1]
    order = torch.sort(distance, dim=-1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(p, device=order.device).expand_as(order))
    return (p - rank).to(torch.float64) / (p + 1)
