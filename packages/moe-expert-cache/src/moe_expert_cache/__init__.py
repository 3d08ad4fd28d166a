"""Predictive expert cache for Mixture-of-Experts models on MLX (mlx-lm).

The public API is what a user calls to load and run a cached model, save and warm-start
its cache state, and seal a checkpoint. The building blocks stay importable from their
modules: the policies (``moe_expert_cache.policies.POLICIES``), the modes
(``moe_expert_cache.config.MODES``), router traces (``moe_expert_cache.trace.RouterTrace``),
profiles (``moe_expert_cache.profile.adaptive_capacity`` and ``pinned_experts``), the
simulator (``moe_expert_cache.simulator.simulate`` and ``SIMULATED``), the slots, the
expert store and the cached layers.
"""

from moe_expert_cache.__about__ import __version__
from moe_expert_cache.config import ExpertCacheConfig
from moe_expert_cache.errors import ExpertCacheError, MissingShardError
from moe_expert_cache.expert_store import seal_model
from moe_expert_cache.generate import generate
from moe_expert_cache.loader import CachedModel, load_cached_model
from moe_expert_cache.manager import config_from_state, read_state

__all__ = [
    "CachedModel",
    "ExpertCacheConfig",
    "ExpertCacheError",
    "MissingShardError",
    "__version__",
    "config_from_state",
    "generate",
    "load_cached_model",
    "read_state",
    "seal_model",
]
