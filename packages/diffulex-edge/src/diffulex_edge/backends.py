"""Forward backends for block-diffusion decoding: one interface, one class per graph.

A backend holds the KV state of one sequence. ``denoise`` scores the active block without
touching the cache; ``commit`` runs the one extra forward that writes a finished block's K/V.
Every block starts at ``cache_len`` (the tokens committed so far), so positions and cache
slots coincide.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from diffulex_edge.kv_cache import DynamicKVCache, StaticCacheLayout
from diffulex_edge.masks import block_attention_mask, block_positions, cache_io_masks
from diffulex_edge.model import SDARModel


class Backend(ABC):
    """block_ids: (1, bs) int64 throughout; logits: (1, bs, vocab) float32."""

    block_size: int
    max_seq: int  # positions/cache slots available to one sequence

    def __init__(self) -> None:
        self.cache_len = 0

    @abstractmethod
    def reset(self) -> None:
        """Drop all committed tokens."""

    @abstractmethod
    def denoise(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the active block at ``cache_len``; the cache is unchanged."""

    @abstractmethod
    def commit(self, block_ids: torch.Tensor) -> None:
        """Write the block's K/V at ``cache_len`` and advance ``cache_len`` by bs."""

    def prefill(self, ids: torch.Tensor) -> None:
        """ids: (1, n * bs) int64: commit whole prompt blocks, one forward each."""
        bs = self.block_size
        for start in range(0, ids.shape[1], bs):
            self.commit(ids[:, start : start + bs])


class EagerDynamic(Backend):
    """``SDARModel.forward`` with a growing cache (the reference, unbounded memory).

    Its only length limit is the RoPE table (``max_position_embeddings``).
    """

    def __init__(self, model: SDARModel, block_size: int) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size
        self.max_seq = model.config.max_position_embeddings
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicKVCache(self.model.config.num_hidden_layers)
        self.cache_len = 0

    def _positions(self) -> torch.Tensor:
        return torch.arange(self.cache_len, self.cache_len + self.block_size)[None]

    @torch.no_grad()
    def denoise(self, block_ids):
        return self.model(block_ids, self._positions(), self.cache)

    @torch.no_grad()
    def commit(self, block_ids):
        self.model(block_ids, self._positions(), self.cache, store_kv=True)
        self.cache_len += self.block_size

    @torch.no_grad()
    def prefill(self, ids):
        """All prompt blocks in one forward under the block-causal mask, as the reference."""
        n = ids.shape[1]
        if n == 0:
            return
        blocks = torch.arange(n) // self.block_size
        mask = (blocks[None, :] <= blocks[:, None])[None]  # (1, n, n)
        self.model(ids, torch.arange(n)[None], self.cache, mask, store_kv=True)
        self.cache_len = n


class StaticCacheBackend(Backend):
    """A backend over a preallocated static KV cache of ``layout`` (eager or .pte)."""

    def __init__(self, layout: StaticCacheLayout) -> None:
        super().__init__()
        self.layout = layout
        self.block_size = layout.block_size
        self.max_seq = layout.max_seq
        self.reset()

    def reset(self) -> None:
        self.kv_cache = self.layout.allocate()
        self.cache_len = 0


class _Static(StaticCacheBackend):
    def __init__(self, model: SDARModel, layout: StaticCacheLayout) -> None:
        if layout.batch != 1:
            raise ValueError(
                f"decoding runs one sequence; layout.batch must be 1, got {layout.batch}"
            )
        self.model = model
        super().__init__(layout)


class EagerCacheIO(_Static):
    """``SDARModel.forward_export`` in eager mode: the whole cache in and out each step."""

    @torch.no_grad()
    def _step(self, block_ids, commit: bool) -> torch.Tensor:
        masks = cache_io_masks(self.layout, self.cache_len, commit)
        logits, self.kv_cache = self.model.forward_export(
            block_ids,
            block_positions(self.layout, self.cache_len),
            self.kv_cache,
            masks.attention_mask,
            masks.insert_matrix,
            masks.keep_mask,
        )
        return logits

    def denoise(self, block_ids):
        return self._step(block_ids, commit=False)

    def commit(self, block_ids):
        self._step(block_ids, commit=True)
        self.cache_len += self.block_size


class EagerBlockKV(_Static):
    """``SDARModel.forward_block_kv`` in eager mode: commit copies block K/V into place."""

    @torch.no_grad()
    def _step(self, block_ids):
        return self.model.forward_block_kv(
            block_ids,
            block_positions(self.layout, self.cache_len),
            self.kv_cache,
            block_attention_mask(self.layout, self.cache_len),
        )

    def denoise(self, block_ids):
        return self._step(block_ids)[0]

    def commit(self, block_ids):
        _, block_kv = self._step(block_ids)
        self.kv_cache[..., self.cache_len : self.cache_len + self.block_size, :] = block_kv
        self.cache_len += self.block_size
