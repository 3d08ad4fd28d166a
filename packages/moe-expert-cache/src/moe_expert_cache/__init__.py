"""Predictive expert cache for Mixture-of-Experts models on MLX (mlx-lm).

The public API is what a user calls to load, run, measure and tune a cached model; the
building blocks (slots, policies, the expert store, the cached layers, the random test
checkpoints) stay importable from their modules.
"""

from moe_expert_cache.__about__ import __version__
from moe_expert_cache.config import MODES, CacheConfig
from moe_expert_cache.errors import ExpertCacheError, MissingShardError
from moe_expert_cache.expert_store import seal_model
from moe_expert_cache.generate import generate
from moe_expert_cache.loader import CachedModel, load_cached_model
from moe_expert_cache.manager import config_from_state, read_state
from moe_expert_cache.policies import POLICIES
from moe_expert_cache.profile import adaptive_capacity, pinned_experts
from moe_expert_cache.simulator import SIMULATED, simulate
from moe_expert_cache.trace import RouterTrace

__all__ = [
    "MODES",
    "POLICIES",
    "SIMULATED",
    "CacheConfig",
    "CachedModel",
    "ExpertCacheError",
    "MissingShardError",
    "RouterTrace",
    "__version__",
    "adaptive_capacity",
    "config_from_state",
    "generate",
    "load_cached_model",
    "pinned_experts",
    "read_state",
    "seal_model",
    "simulate",
]
