"""Predictive expert cache for Mixture-of-Experts models on MLX (mlx-lm)."""

from moe_expert_cache.__about__ import __version__
from moe_expert_cache.cached_layers import PredictiveCachedSwitchLinear
from moe_expert_cache.config import MODES, CacheConfig
from moe_expert_cache.errors import ExpertCacheError, MissingShardError
from moe_expert_cache.expert_store import ExpertStore, seal_model
from moe_expert_cache.generate import GenerationResult, generate
from moe_expert_cache.layer_cache import LayerCache, LayerMetrics
from moe_expert_cache.loader import CachedModel, find_moe_blocks, load_cached_model, patch_model
from moe_expert_cache.manager import ExpertCacheManager, config_from_state, read_state
from moe_expert_cache.moe_blocks import BLOCKS, CachedMoeBlock
from moe_expert_cache.policies import POLICIES, EvictionPolicy, make_policy
from moe_expert_cache.profile import adaptive_capacity, pinned_experts, usage_share
from moe_expert_cache.random_model import ARCHITECTURES, random_moe_config, write_random_moe
from moe_expert_cache.simulator import SIMULATED, simulate, synthetic_trace
from moe_expert_cache.slots import ExpertSlots
from moe_expert_cache.trace import RouterTrace

__all__ = [
    "ARCHITECTURES",
    "BLOCKS",
    "MODES",
    "POLICIES",
    "SIMULATED",
    "CacheConfig",
    "CachedModel",
    "CachedMoeBlock",
    "EvictionPolicy",
    "ExpertCacheError",
    "ExpertCacheManager",
    "ExpertSlots",
    "ExpertStore",
    "GenerationResult",
    "LayerCache",
    "LayerMetrics",
    "MissingShardError",
    "PredictiveCachedSwitchLinear",
    "RouterTrace",
    "__version__",
    "adaptive_capacity",
    "config_from_state",
    "find_moe_blocks",
    "generate",
    "load_cached_model",
    "make_policy",
    "patch_model",
    "pinned_experts",
    "random_moe_config",
    "read_state",
    "seal_model",
    "simulate",
    "synthetic_trace",
    "usage_share",
    "write_random_moe",
]
