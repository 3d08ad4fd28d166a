"""Paired-replacement weight cache for contextually sparse MLPs (C core through cffi)."""

from paired_cache.__about__ import __version__
from paired_cache._core import core_info
from paired_cache.cache import (
    SUPPORTED_DTYPES,
    CacheInvariantError,
    CacheStats,
    PairedCache,
    UpdateInfo,
)
from paired_cache.config import CacheConfig
from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import (
    MASK_SOURCES,
    CatsMask,
    FixedMask,
    LowRankPredictor,
    MaskSource,
    OracleTopK,
)
from paired_cache.model_io import convert, load_sparse, save_dense
from paired_cache.pool_file import PoolFile, write_pool_file
from paired_cache.sparse_ffn import SparseFFN
from paired_cache.sparse_mlp import SparseMLP, collect_mlp_inputs, sparsify_model

__all__ = [
    "MASK_SOURCES",
    "SUPPORTED_DTYPES",
    "CacheConfig",
    "CacheInvariantError",
    "CacheStats",
    "CatsMask",
    "FixedMask",
    "LowRankPredictor",
    "MaskSource",
    "OracleTopK",
    "PairedCache",
    "PairedCacheError",
    "PoolFile",
    "SparseFFN",
    "SparseMLP",
    "UpdateInfo",
    "__version__",
    "collect_mlp_inputs",
    "convert",
    "core_info",
    "load_sparse",
    "save_dense",
    "sparsify_model",
    "write_pool_file",
]
