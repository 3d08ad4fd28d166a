"""The cache's configuration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moe_expert_cache.policies import POLICIES

MODES = ("exact", "skip")


@dataclass
class CacheConfig:
    """How many experts stay resident and how misses are handled.

    ``capacity``: a float in (0, 1] is a share of each layer's experts; an int is a count
    per layer; a sequence gives one count per MoE layer (adaptive capacity, see
    :func:`moe_expert_cache.profile.adaptive_capacity`).
    ``mode``: ``exact`` loads misses before the layer computes (stock output); ``skip``
    computes without them and loads them between tokens.
    ``pinned``: MoE layer number -> experts that never leave. ``initial``: MoE layer number
    -> experts to load first (a warm start). ``max_layer_updates``: at most this many layers
    swap per between-token update; ``max_swaps_per_layer``: at most this many swaps each
    (``None``: no limit).
    """

    capacity: float | int | Sequence[int] = 0.5
    mode: str = "exact"
    policy: str = "lcp"
    pinned: Mapping[int, Sequence[int]] = field(default_factory=dict)
    initial: Mapping[int, Sequence[int]] = field(default_factory=dict)
    max_layer_updates: int | None = None
    max_swaps_per_layer: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        c = self.capacity
        if isinstance(c, bool) or not isinstance(c, (int, float, Sequence)):
            raise ValueError(f"capacity must be a float share, an int or a list, got {c!r}")
        if isinstance(c, float) and not 0.0 < c <= 1.0:
            raise ValueError(f"capacity as a share must be in (0, 1], got {c}")
        if isinstance(c, Sequence) and not all(
            isinstance(n, int) and not isinstance(n, bool) for n in c
        ):
            raise ValueError(f"per-layer capacity must be a list of ints, got {c!r}")
        for name in ("max_layer_updates", "max_swaps_per_layer"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {v!r}")

    def layer_capacities(self, num_experts: Sequence[int], top_k: int) -> list[int]:
        """Resident experts per MoE layer, checked against ``top_k`` and each layer's size."""
        c = self.capacity
        if isinstance(c, Sequence):
            if len(c) != len(num_experts):
                raise ValueError(
                    f"capacity lists {len(c)} layers, the model has {len(num_experts)} MoE layers"
                )
            caps = list(c)
        elif isinstance(c, float):
            caps = [round(c * e) for e in num_experts]
        else:
            caps = [c] * len(num_experts)
        for i, (cap, e) in enumerate(zip(caps, num_experts, strict=True)):
            if not top_k <= cap <= e:
                raise ValueError(
                    f"capacity {c!r} gives {cap} experts in MoE layer {i}; expected between "
                    f"top_k={top_k} and num_experts={e}"
                )
        return caps
