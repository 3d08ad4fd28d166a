"""Offline replay of router traces under each eviction policy and Belady's optimum.

The replay is the exact mode's demand loading, token by token: a token's missing experts
are loaded before it computes, evicting residents that the token does not need, chosen by
the policy from the statistics of the tokens before it. Belady evicts the resident needed
farthest in the future, which no online policy can beat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.policies import POLICIES, LCPPolicy, make_policy
from moe_expert_cache.slots import ExpertSlots
from moe_expert_cache.trace import RouterTrace

SIMULATED = (*POLICIES, "belady")


class BeladyOracle:
    """Belady's MIN with the future known: ``choose_victims`` like an EvictionPolicy."""

    def __init__(self, requests: np.ndarray, num_experts: int):
        """requests: int (tokens, top_k) expert ids of one layer in token order."""
        never = len(requests) + 1
        self.next_use = np.empty((len(requests), num_experts), dtype=np.int64)
        upcoming = np.full(num_experts, never, dtype=np.int64)
        for t in range(len(requests) - 1, -1, -1):
            self.next_use[t] = upcoming  # first request strictly after t
            upcoming[requests[t]] = t

    def record(self, experts, step: int) -> None:
        """Belady needs no statistics; the future is in ``next_use``."""

    def choose_victims(self, candidates: Sequence[int], n: int, step: int) -> list[int]:
        cand = np.asarray(candidates, dtype=np.int64)
        order = np.lexsort((cand, -self.next_use[step][cand]))
        return [int(e) for e in cand[order[:n]]]


def replay_layer(
    requests: np.ndarray,
    num_experts: int,
    capacity: int,
    policy: str,
    pinned=(),
    lcp: tuple[float, float] | None = None,
) -> int:
    """Hits of one layer's ``requests`` (tokens, top_k) at ``capacity`` under ``policy``;
    ``lcp``: LCP's ``(decay, horizon)`` where not the defaults."""
    if policy not in SIMULATED:
        raise ExpertCacheError(f"policy must be one of {SIMULATED}, got {policy!r}")
    top_k = requests.shape[1]
    slots = ExpertSlots(num_experts, capacity, top_k, pinned)
    if policy == "belady":
        chooser = BeladyOracle(requests, num_experts)
    elif policy == "lcp" and lcp is not None:
        chooser = LCPPolicy(num_experts, *lcp)
    else:
        chooser = make_policy(policy, num_experts)
    hits = 0
    for t, row in enumerate(requests.tolist()):
        hits += sum(slots.is_resident(e) for e in row)
        slots.apply(slots.plan(row, row, chooser, t))
        chooser.record(row, t)
    return hits


@dataclass
class SimulationRow:
    policy: str
    capacity: int
    hits: int
    requests: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


def simulate(
    trace: RouterTrace,
    capacities: Sequence[float | int],
    policies: Sequence[str] = SIMULATED,
    lcp: tuple[float, float] | None = None,
) -> list[SimulationRow]:
    """Hit rates of ``trace`` for every policy and capacity (a share in (0, 1] or a count),
    summed over layers; ``lcp``: LCP's ``(decay, horizon)`` where not the defaults."""
    out = []
    layers = [trace.layer_requests(i) for i in range(trace.num_layers)]
    for cap in capacities:
        count = round(cap * trace.num_experts) if isinstance(cap, float) else cap
        if not trace.top_k <= count <= trace.num_experts:
            raise ExpertCacheError(
                f"capacity {cap} is {count} experts; expected between top_k={trace.top_k} "
                f"and num_experts={trace.num_experts}"
            )
        for policy in policies:
            hits = sum(replay_layer(r, trace.num_experts, count, policy, lcp=lcp) for r in layers)
            out.append(SimulationRow(policy, count, hits, sum(r.size for r in layers)))
    return out


def synthetic_trace(
    num_layers: int,
    num_experts: int,
    top_k: int,
    tokens: int,
    *,
    hot: int | None = None,
    locality: float = 0.8,
    mean_phase: int = 64,
    seed: int = 0,
) -> RouterTrace:
    """A trace with temporal locality: each layer has a ``hot`` working set that is
    replaced after phases of about ``mean_phase`` tokens; a token draws each expert from
    the hot set with probability ``locality``, else from all experts (Zipf-weighted)."""
    if not 0.0 <= locality <= 1.0:
        raise ExpertCacheError(f"locality must be in [0, 1], got {locality}")
    rng = np.random.default_rng(seed)
    hot = hot or 2 * top_k
    if not top_k <= hot <= num_experts:
        raise ExpertCacheError(f"hot must be in [top_k, num_experts], got {hot}")
    zipf = 1.0 / np.arange(1, num_experts + 1)
    zipf /= zipf.sum()
    layers = []
    for _ in range(num_layers):
        popularity = rng.permutation(num_experts)
        hot_set = rng.choice(num_experts, hot, replace=False, p=zipf[np.argsort(popularity)])
        phase_end = rng.geometric(1 / mean_phase)
        rows = np.empty((tokens, top_k), dtype=np.int32)
        for t in range(tokens):
            if t >= phase_end:
                hot_set = rng.choice(num_experts, hot, replace=False)
                phase_end = t + rng.geometric(1 / mean_phase)
            chosen: list[int] = []
            while len(chosen) < top_k:
                if rng.random() < locality:
                    e = int(rng.choice(hot_set))
                else:
                    e = int(popularity[rng.choice(num_experts, p=zipf)])
                if e not in chosen:
                    chosen.append(e)
            rows[t] = chosen
        layers.append(rows)
    return RouterTrace.from_requests(layers, num_experts)
