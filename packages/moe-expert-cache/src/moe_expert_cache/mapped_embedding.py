"""The input embedding table left in the mmap'd shard
(``ExpertCacheConfig(map_embeddings=True)``).

A decoder reads one embedding row per token, but mlx-lm materialises the whole table: on
the MoEfied SmolLM2 that is 49,152 x 576 float32, 108 MiB of anonymous memory (MLX's CPU
buffers), which a hard memory limit cannot reclaim. :class:`MappedEmbedding` keeps the
table in the shard's read-only memory map, a file-backed mapping the kernel can evict
and read again, and copies out only the rows of the tokens of each forward. The values
are the stored ones, so the output is the stock model's.

Only an embedding that is not also the output layer can be mapped: a tied ``lm_head``
multiplies by the whole table every token. Quantized tables are refused (they are a
fraction of the size, and their scales would need mapping too).
"""

from __future__ import annotations

import zlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.safetensors_io import FLOAT_DTYPES, SafetensorsShard, TensorInfo

EMBEDDING_KEY = "model.embed_tokens.weight"


class MappedEmbedding(nn.Module):
    """``nn.Embedding`` whose table stays in a memory-mapped shard: each call copies the
    rows of its ids (``(..., )`` int) out of the map, ``(..., dims)`` in the stored dtype."""

    def __init__(self, shard: SafetensorsShard, info: TensorInfo):
        super().__init__()
        self._shard, self._info = shard, info  # underscored: not parameters or children
        self._table = shard.array_view(info)  # (vocab, dims), read-only, file-backed
        self.num_embeddings, self.dims = info.shape

    def __call__(self, x: mx.array) -> mx.array:
        ids = np.asarray(x)  # evaluates x: the ids pick the rows
        if ids.dtype.kind not in "iu":
            raise ExpertCacheError(f"embedding ids must be integers, got {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise ExpertCacheError(
                f"token id outside the embedding table [0, {self.num_embeddings}): "
                f"min {ids.min()}, max {ids.max()}"
            )
        rows = mx.array(self._table[ids])  # fancy indexing copies just these rows
        return rows.view(mx.bfloat16) if self._info.dtype == "BF16" else rows

    def as_linear(self, x: mx.array) -> mx.array:
        raise ExpertCacheError(
            "a mapped embedding cannot serve as the output layer (tie_word_embeddings): "
            "load without map_embeddings"
        )

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, mapped from {self._info.shard.name}"


def map_embedding(model: nn.Module, store) -> MappedEmbedding:
    """Replace ``model.model.embed_tokens`` with a :class:`MappedEmbedding` of the table in
    ``store`` (an :class:`~moe_expert_cache.expert_store.ExpertStore`).

    Checked first, nothing changed on refusal: the model must have a separate ``lm_head``
    (an untied embedding), ``model.model.embed_tokens`` must be a plain ``nn.Embedding``,
    and the stored table a float tensor of its shape (and, with an integrity record, of
    its CRC-32, read once through the map).
    """
    inner = getattr(model, "model", None)
    stock = getattr(inner, "embed_tokens", None) if isinstance(inner, nn.Module) else None
    if type(stock) is not nn.Embedding:
        raise ExpertCacheError(
            f"map_embeddings needs model.model.embed_tokens to be an nn.Embedding, got "
            f"{type(stock).__name__} (quantized embedding tables are not mapped)"
        )
    if "lm_head" not in model:
        raise ExpertCacheError(
            "map_embeddings needs an untied lm_head: this model multiplies by its embedding "
            "table every token (tie_word_embeddings)"
        )
    found = store.tensor(EMBEDDING_KEY)
    if found is None:
        raise ExpertCacheError(f"{store.model_dir}: map_embeddings: no {EMBEDDING_KEY!r}")
    info, shard, crc32 = found
    if store.tensor("model.embed_tokens.scales") is not None:
        raise ExpertCacheError(
            f"{store.model_dir}: the embedding table is quantized; quantized embedding "
            "tables are not mapped (load without map_embeddings)"
        )
    if info.dtype not in FLOAT_DTYPES or info.shape != tuple(stock.weight.shape):
        raise ExpertCacheError(
            f"{info.shard}: {EMBEDDING_KEY!r} is {info.dtype} {list(info.shape)}, expected a "
            f"float tensor of shape {list(stock.weight.shape)} for this config.json"
        )
    mapped = MappedEmbedding(shard, info)
    if crc32 is not None and zlib.crc32(mapped._table) != crc32:
        raise ExpertCacheError(
            f"{info.shard}: tensor {EMBEDDING_KEY!r} fails its CRC-32 from the integrity "
            "record (the weights were changed or damaged)"
        )
    inner.embed_tokens = mapped
    return mapped
