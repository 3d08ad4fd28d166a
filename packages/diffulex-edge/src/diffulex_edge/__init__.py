"""Block-diffusion LM inference with a static KV cache, exported to ExecuTorch."""

from diffulex_edge.__about__ import __version__
from diffulex_edge.backends import (
    Backend,
    EagerBlockKV,
    EagerCacheIO,
    EagerDynamic,
    StaticBackend,
)
from diffulex_edge.checkpoint import load_checkpoint, save_checkpoint
from diffulex_edge.config import SDARConfig, sdar_1p7b_config, tiny_config
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.export import (
    EXPORT_VARIANTS,
    QUANTIZATIONS,
    ExportResult,
    export_pte,
    quantize_8da4w,
)
from diffulex_edge.generate import (
    GenerationConfig,
    GenerationResult,
    generate,
    generate_autoregressive,
)
from diffulex_edge.hf_import import from_hf_model, load_gguf
from diffulex_edge.kv_cache import DynamicKVCache, StaticCacheLayout
from diffulex_edge.masks import CacheIOMasks, block_attention_mask, cache_io_masks
from diffulex_edge.model import SDARModel, random_model
from diffulex_edge.remasking import REMASKING
from diffulex_edge.runtime import PteEngine
from diffulex_edge.sampling import SamplingConfig
from diffulex_edge.task import trained_checkpoint

__all__ = [
    "EXPORT_VARIANTS",
    "QUANTIZATIONS",
    "REMASKING",
    "Backend",
    "CacheIOMasks",
    "DiffulexEdgeError",
    "DynamicKVCache",
    "EagerBlockKV",
    "EagerCacheIO",
    "EagerDynamic",
    "ExportResult",
    "GenerationConfig",
    "GenerationResult",
    "PteEngine",
    "SDARConfig",
    "SDARModel",
    "SamplingConfig",
    "StaticBackend",
    "StaticCacheLayout",
    "__version__",
    "block_attention_mask",
    "cache_io_masks",
    "export_pte",
    "from_hf_model",
    "generate",
    "generate_autoregressive",
    "load_checkpoint",
    "load_gguf",
    "quantize_8da4w",
    "random_model",
    "save_checkpoint",
    "sdar_1p7b_config",
    "tiny_config",
    "trained_checkpoint",
]
