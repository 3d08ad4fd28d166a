"""Paired-replacement weight cache for contextually sparse MLPs (C core through cffi).

What a user calls is here; the building blocks (the cache itself, the mask sources, the
pool file, the trained predictor) stay in their modules, listed in the README's "API"."""

from paired_cache.__about__ import __version__
from paired_cache.config import PairedCacheConfig
from paired_cache.errors import PairedCacheError
from paired_cache.model_io import convert, load_sparse, save_dense
from paired_cache.registry import MASK_SOURCES
from paired_cache.sparse_ffn import SparseFFN
from paired_cache.sparse_mlp import SparseMLP, sparsify_model

__all__ = [
    "MASK_SOURCES",
    "PairedCacheConfig",
    "PairedCacheError",
    "SparseFFN",
    "SparseMLP",
    "__version__",
    "convert",
    "load_sparse",
    "save_dense",
    "sparsify_model",
]
