"""The cache's configuration."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.policies import POLICIES

MODES = ("exact", "skip")
# The share of each layer's experts kept resident when neither capacity nor
# capacity_share is given.
DEFAULT_CAPACITY_SHARE = 0.5


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_float(v) -> bool:
    return isinstance(v, (float, np.floating))


@dataclass
class ExpertCacheConfig:
    """How many experts stay resident and how misses are handled; checked on construction.

    Give at most one of ``capacity`` and ``capacity_share``; with neither, half of each
    layer's experts are resident (``capacity_share=0.5``).

    Args:
        capacity: The experts resident in each MoE layer, an int; or a sequence, one count
            per MoE layer (adaptive capacity, see
            :func:`moe_expert_cache.profile.adaptive_capacity`). A float here is
            deprecated: it is read as ``capacity_share`` with a ``DeprecationWarning``.
        capacity_share: A number in (0, 1], the share of each MoE layer's experts
            resident, rounded to the nearest count (``capacity_share=1`` keeps every
            expert, ``capacity=1`` one).
        mode: ``"exact"`` loads misses before the layer computes (stock output);
            ``"skip"`` computes without them and loads them between tokens.
        policy: The eviction policy, a name in ``moe_expert_cache.policies.POLICIES``.
        pinned: MoE layer number -> experts that never leave.
        initial: MoE layer number -> experts to load first (a warm start).
        max_layer_updates: At most this many layers swap per between-token update
            (``None``: no limit).
        max_swaps_per_layer: At most this many swaps in each (``None``: no limit).
        num_experts: When set (a warm start from a saved state, see
            :func:`moe_expert_cache.manager.config_from_state`), the model must have
            exactly these experts per MoE layer.
        top_k: When set, likewise the model's top-k.
        prefetch: Speculative prefetch (exact mode only, see
            :mod:`moe_expert_cache.prefetch`): before each MoE layer after the first runs
            its attention, its router is applied to its input and the guessed experts that
            are not resident are read on a background thread. The output stays the stock
            model's.
        map_embeddings: Leave the input embedding table in the mmap'd shard and copy out
            only each forward's rows (see :mod:`moe_expert_cache.mapped_embedding`):
            file-backed memory a hard limit can evict, instead of the whole table in MLX's
            anonymous buffers. Needs an untied float embedding; the output stays the stock
            model's.

    Raises:
        ExpertCacheError: A field of the wrong type or out of range, named.
    """

    capacity: int | Sequence[int] | None = None
    capacity_share: float | None = None
    mode: str = "exact"
    policy: str = "lcp"
    pinned: Mapping[int, Sequence[int]] = field(default_factory=dict)
    initial: Mapping[int, Sequence[int]] = field(default_factory=dict)
    max_layer_updates: int | None = None
    max_swaps_per_layer: int | None = None
    num_experts: Sequence[int] | None = None
    top_k: int | None = None
    prefetch: bool = False
    map_embeddings: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ExpertCacheError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("prefetch", "map_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ExpertCacheError(f"{name} must be True or False, got {v!r}")
            setattr(self, name, bool(v))
        if self.prefetch and self.mode != "exact":
            # Skip mode never waits for the router's choice; taking the guess would.
            raise ExpertCacheError(
                f"prefetch=True needs mode='exact' (skip mode never waits for a load), "
                f"got mode={self.mode!r}"
            )
        if self.policy not in POLICIES:
            raise ExpertCacheError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        self._check_capacity()
        for name in ("max_layer_updates", "max_swaps_per_layer", "top_k"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ExpertCacheError(f"{name} must be None or an int >= 0, got {v!r}")
        if self.num_experts is not None and (
            isinstance(self.num_experts, (str, bytes))
            or not isinstance(self.num_experts, Sequence)
            or not all(_is_int(n) and n >= 1 for n in self.num_experts)
        ):
            raise ExpertCacheError(
                f"num_experts must be None or a list of ints >= 1, got {self.num_experts!r}"
            )
        for name in ("pinned", "initial"):
            v = getattr(self, name)
            if not isinstance(v, Mapping) or not all(
                _is_int(k)
                and k >= 0
                and isinstance(ids, Sequence)
                and not isinstance(ids, (str, bytes))
                and all(_is_int(e) for e in ids)
                for k, ids in v.items()
            ):
                raise ExpertCacheError(
                    f"{name} must map MoE layer numbers to lists of int expert ids, got {v!r}"
                )

    def layer_capacities(self, num_experts: Sequence[int], top_k: int) -> list[int]:
        """Resident experts per MoE layer, checked against ``top_k`` and each layer's size.

        Args:
            num_experts: Each MoE layer's number of experts, in model order.
            top_k: The experts each token is routed to.

        Returns:
            The resident experts of each layer, each in ``[top_k, num_experts]``.

        Raises:
            ExpertCacheError: A saved state made for other layer sizes or another top-k, or a
                capacity that does not fit a layer.
        """
        if self.num_experts is not None and list(self.num_experts) != list(num_experts):
            raise ExpertCacheError(
                f"the saved state is for {list(self.num_experts)} experts per MoE layer, the "
                f"model has {list(num_experts)}"
            )
        if self.top_k is not None and self.top_k != top_k:
            raise ExpertCacheError(
                f"the saved state is for top_k={self.top_k}, the model routes top_k={top_k}"
            )
        c = self.capacity
        if c is None:
            share = DEFAULT_CAPACITY_SHARE if self.capacity_share is None else self.capacity_share
            given = f"capacity_share={share!r}"
            caps = [round(share * e) for e in num_experts]
        elif isinstance(c, Sequence):
            if len(c) != len(num_experts):
                raise ExpertCacheError(
                    f"capacity lists {len(c)} layers, the model has {len(num_experts)} MoE layers"
                )
            given, caps = f"capacity={list(c)!r}", [int(n) for n in c]
        else:
            given, caps = f"capacity={c!r}", [int(c)] * len(num_experts)
        for i, (cap, e) in enumerate(zip(caps, num_experts, strict=True)):
            if not top_k <= cap <= e:
                raise ExpertCacheError(
                    f"{given} gives {cap} experts in MoE layer {i}; expected between "
                    f"top_k={top_k} and num_experts={e}"
                )
        return caps

    def _check_capacity(self) -> None:
        """At most one of ``capacity`` (a count) and ``capacity_share`` (a share); a float
        ``capacity`` (the share before 0.9) moves to ``capacity_share`` with a warning."""
        c, share = self.capacity, self.capacity_share
        if _is_float(c):
            if share is not None:
                raise ExpertCacheError(
                    f"give capacity (experts per layer) or capacity_share (a share of each "
                    f"layer's experts), not both: got capacity={c!r}, capacity_share={share!r}"
                )
            warnings.warn(
                f"a float capacity is a share: pass capacity_share={c!r} instead of "
                f"capacity={c!r} (capacity is now an int count of experts per layer)",
                DeprecationWarning,
                stacklevel=4,  # _check_capacity, __post_init__, __init__, the caller
            )
            c, share = None, c
        if c is not None and share is not None:
            raise ExpertCacheError(
                f"give capacity (experts per layer) or capacity_share (a share of each "
                f"layer's experts), not both: got capacity={c!r}, capacity_share={share!r}"
            )
        if c is not None and not _is_int(c):
            if isinstance(c, (str, bytes)) or not isinstance(c, Sequence):
                raise ExpertCacheError(
                    f"capacity must be an int (experts per layer) or a list of ints (one per "
                    f"MoE layer), got {c!r}; for a share of each layer's experts use "
                    f"capacity_share"
                )
            if not all(_is_int(n) for n in c):
                raise ExpertCacheError(f"per-layer capacity must be a list of ints, got {c!r}")
        if share is not None:
            if not (_is_float(share) or _is_int(share)) or not 0.0 < share <= 1.0:
                raise ExpertCacheError(f"capacity_share must be a number in (0, 1], got {share!r}")
            share = float(share)
        self.capacity, self.capacity_share = c, share


def __getattr__(name: str):
    # CacheConfig was renamed in 0.9.0 (paired-cache has its own PairedCacheConfig); the
    # old name still works from this module, with a warning.
    if name == "CacheConfig":
        warnings.warn(
            "moe_expert_cache.config.CacheConfig is deprecated; use ExpertCacheConfig",
            DeprecationWarning,
            stacklevel=2,
        )
        return ExpertCacheConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
