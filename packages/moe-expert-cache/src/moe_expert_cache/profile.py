"""Profiles from a router trace: experts to pin, and capacity per layer."""

from __future__ import annotations

import numpy as np

from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.trace import RouterTrace


def usage_share(trace: RouterTrace) -> np.ndarray:
    """float (num_layers, num_experts): the share of tokens that requested each expert."""
    share = np.zeros((trace.num_layers, trace.num_experts))
    for layer in range(trace.num_layers):
        req = trace.layer_requests(layer)
        if len(req):
            share[layer] = np.bincount(req.ravel(), minlength=trace.num_experts) / len(req)
    return share


def pinned_experts(
    trace: RouterTrace, threshold: float, max_per_layer: int | None = None
) -> dict[int, list[int]]:
    """Per MoE layer, the experts used by more than ``threshold`` of the profiled tokens,
    most used first, at most ``max_per_layer`` (pass ``capacity - top_k``)."""
    if not 0.0 <= threshold <= 1.0:
        raise ExpertCacheError(f"threshold must be in [0, 1], got {threshold}")
    out = {}
    for layer, share in enumerate(usage_share(trace)):
        experts = [int(e) for e in np.argsort(-share, kind="stable") if share[e] > threshold]
        out[layer] = experts[:max_per_layer] if max_per_layer is not None else experts
    return out


def adaptive_capacity(trace: RouterTrace, total: int) -> list[int]:
    """Split ``total`` resident slots over the layers, each getting at least ``top_k``:
    every further slot goes to the layer whose next most used expert serves the largest
    share of tokens (greedy coverage of the profiled requests)."""
    n_layers, k = trace.num_layers, trace.top_k
    if not n_layers * k <= total <= n_layers * trace.num_experts:
        raise ExpertCacheError(
            f"total must be in [{n_layers * k}, {n_layers * trace.num_experts}], got {total}"
        )
    ranked = -np.sort(-usage_share(trace), axis=1)  # (layers, experts), most used first
    caps = [k] * n_layers
    for _ in range(total - n_layers * k):
        gains = [ranked[i, c] if c < trace.num_experts else -1.0 for i, c in enumerate(caps)]
        caps[int(np.argmax(gains))] += 1
    return caps
