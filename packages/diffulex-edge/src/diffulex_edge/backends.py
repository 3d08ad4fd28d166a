"""Forward backends for block-diffusion decoding: one interface, two implementations.

A backend holds the KV state of one sequence. ``denoise`` scores the active block without
touching the cache; ``commit`` runs the one extra forward that writes a finished block's K/V
(and returns its logits: with block size 1 that forward is an autoregressive decode step).
Every block starts at ``cache_len`` (the tokens committed so far), so positions and cache
slots coincide.

:class:`EagerDynamic` is the reference with a growing cache. :class:`StaticBackend` owns a
preallocated cache and drives a *step callable* — the eager model's static graph or an
ExecuTorch method, the same inputs either way — building the masks and committing block K/V.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from diffulex_edge.kv_cache import DynamicKVCache, StaticCacheLayout
from diffulex_edge.masks import (
    block_attention_mask,
    block_positions,
    cache_io_masks,
    causal_chunk_mask,
    chunk_positions,
)
from diffulex_edge.model import SDARModel

VARIANTS = ("cache_io", "block_kv", "static_kv")


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
        """Logits of the active block at ``cache_len``; the cache is unchanged.

        Args:
            block_ids: (1, bs) int64, the block's current tokens (masks included).

        Returns:
            (1, bs, vocab) float logits.
        """

    @abstractmethod
    def commit(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Write the block's K/V at ``cache_len`` and advance ``cache_len`` by bs.

        Args:
            block_ids: (1, bs) int64, the block's final tokens.

        Returns:
            (1, bs, vocab) float logits of the block.
        """

    def prefill(self, ids: torch.Tensor) -> None:
        """Commit whole prompt blocks, one forward each.

        Args:
            ids: (1, n * bs) int64 prompt tokens.
        """
        bs = self.block_size
        for start in range(0, ids.shape[1], bs):
            self.commit(ids[:, start : start + bs])

    def prefill_causal(self, ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """A prompt under the causal mask of an autoregressive model, committed after what
        is cached. This default commits one token per forward (block size 1); backends with
        a chunked path override it.

        Args:
            ids: (1, n) int64 prompt tokens, n >= 1.
            all_logits: Return every token's logits (for perplexity), not just the last's.

        Returns:
            (1, vocab) float logits of the last token, or (1, n, vocab) with ``all_logits``.

        Raises:
            ValueError: An empty prompt, or a block size other than 1.
        """
        if self.block_size != 1:
            raise ValueError(
                f"causal prefill token by token needs block_size 1, this backend has "
                f"{self.block_size}"
            )
        if ids.shape[1] == 0:
            raise ValueError("prefill_causal needs at least one token")
        out = [self.commit(ids[:, start : start + 1]) for start in range(ids.shape[1])]
        return torch.cat(out, dim=1) if all_logits else out[-1][:, -1]


class EagerDynamic(Backend):
    """``SDARModel.forward`` with a growing cache (the reference, unbounded memory).

    Its only length limit is the RoPE table (``max_position_embeddings``).

    Args:
        model: the model to run eagerly.
        block_size: tokens per forward: the model's block size for :func:`generate`, 1 for
            :func:`generate_autoregressive`.
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
        logits = self.model(block_ids, self._positions(), self.cache, store_kv=True)
        self.cache_len += self.block_size
        return logits

    @torch.no_grad()
    def prefill(self, ids):
        """All prompt blocks in one forward under the block-causal mask, as the reference.

        Args:
            ids: (1, n * bs) int64 prompt tokens.
        """
        n = ids.shape[1]
        if n == 0:
            return
        blocks = torch.arange(n) // self.block_size
        mask = (blocks[None, :] <= blocks[:, None])[None]  # (1, n, n)
        self.model(ids, torch.arange(n)[None], self.cache, mask, store_kv=True)
        self.cache_len = n

    @torch.no_grad()
    def prefill_causal(self, ids, all_logits=False):
        """The whole prompt in one forward under the causal mask, after what is cached.

        Args:
            ids: (1, n) int64 prompt tokens, n >= 1.
            all_logits: Return every token's logits, not just the last's.

        Returns:
            (1, vocab) float logits of the last token, or (1, n, vocab) with ``all_logits``.
        """
        n, past = ids.shape[1], self.cache_len
        if n == 0:
            raise ValueError("prefill_causal needs at least one token")
        mask = torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)[None]
        positions = torch.arange(past, past + n)[None]
        logits = self.model(ids, positions, self.cache, mask, store_kv=True)
        self.cache_len = past + n
        return logits if all_logits else logits[:, -1]


class StaticBackend(Backend):
    """A preallocated KV cache of ``layout`` driven by ``step``, one graph call per forward.

    ``variant`` names the step's signature (as exported, :data:`VARIANTS`):

    - ``block_kv``: ``step(ids, positions, kv_cache, attention_mask) -> (logits, block_kv)``;
      the cache is read only and a commit copies ``block_kv`` into its slots here.
    - ``cache_io``: ``step(ids, positions, kv_cache, attention_mask, insert_matrix,
      keep_mask) -> (logits, kv_cache)``; the graph returns the whole updated cache.
    - ``static_kv``: ``step(ids, input_pos) -> (logits,)`` with ``input_pos`` the (1,)
      start; the cache is the step's own state (``kv_cache`` is None here) and every
      forward writes its tokens' K/V at ``cache_len``, so a commit only advances it.

    ``prefill_step`` (block_kv signature, blocks of ``prefill_size`` tokens) runs
    :meth:`prefill_causal` in chunks instead of one forward per token.
    """

    def __init__(
        self,
        layout: StaticCacheLayout,
        variant: str,
        step,
        prefill_step=None,
        prefill_size: int | None = None,
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if layout.batch != 1:
            raise ValueError(
                f"decoding runs one sequence; layout.batch must be 1, got {layout.batch}"
            )
        if (prefill_step is None) != (prefill_size is None):
            raise ValueError("prefill_step and prefill_size go together")
        self.layout = layout
        self.variant = variant
        self.step = step
        self.block_size = layout.block_size
        self.max_seq = layout.max_seq
        self.prefill_step = prefill_step
        self.prefill_layout = None
        if prefill_size is not None:
            self.prefill_layout = StaticCacheLayout(
                layout.num_layers,
                1,
                layout.kv_heads,
                layout.max_seq,
                layout.head_dim,
                prefill_size,
                layout.dtype,
            )
        self.reset()

    def reset(self) -> None:
        # static_kv: slots past cache_len are never read before a forward rewrites them.
        self.kv_cache = None if self.variant == "static_kv" else self.layout.allocate()
        self.cache_len = 0

    def _start(self, tokens: int) -> torch.Tensor:
        """static_kv's input_pos for ``tokens`` tokens at cache_len (ValueError past max_seq:
        the program's kernels do not check)."""
        if self.cache_len + tokens > self.max_seq:
            raise ValueError(
                f"a block of {tokens} tokens after cache_len {self.cache_len} does not fit "
                f"max_seq {self.max_seq}"
            )
        return torch.tensor([self.cache_len])

    def _forward(self, block_ids: torch.Tensor, commit: bool) -> torch.Tensor:
        if self.variant == "static_kv":
            return self.step(block_ids, self._start(block_ids.shape[1]))[0]
        positions = block_positions(self.layout, self.cache_len)
        if self.variant == "cache_io":
            m = cache_io_masks(self.layout, self.cache_len, commit)
            logits, self.kv_cache = self.step(
                block_ids, positions, self.kv_cache, m.attention_mask, m.insert_matrix, m.keep_mask
            )
            return logits
        mask = block_attention_mask(self.layout, self.cache_len)
        logits, block_kv = self.step(block_ids, positions, self.kv_cache, mask)
        if commit:
            end = self.cache_len + self.block_size
            self.kv_cache[..., self.cache_len : end, :] = block_kv
        return logits

    def denoise(self, block_ids):
        return self._forward(block_ids, commit=False)

    def commit(self, block_ids):
        logits = self._forward(block_ids, commit=True)
        self.cache_len += self.block_size
        return logits

    def prefill_causal(self, ids, all_logits=False):
        """Chunks of ``prefill_size`` under the causal mask, one forward each; the last chunk
        is padded and only its real tokens' K/V are kept."""
        if self.prefill_step is None:
            return super().prefill_causal(ids, all_logits)
        n = ids.shape[1]
        if n == 0:
            raise ValueError("prefill_causal needs at least one token")
        if self.cache_len + n > self.max_seq:  # before any chunk runs: nothing half-written
            raise ValueError(
                f"a prompt of {n} tokens after cache_len {self.cache_len} does not fit "
                f"max_seq {self.max_seq}"
            )
        size = self.prefill_layout.block_size
        out = []
        if self.variant == "static_kv":  # chunks of any length: no padding
            for start in range(0, n, size):
                chunk = ids[:, start : start + size]
                out.append(self.prefill_step(chunk, self._start(chunk.shape[1]))[0])
                self.cache_len += chunk.shape[1]
            return torch.cat(out, dim=1) if all_logits else out[-1][:, -1]
        for start in range(0, n, size):
            valid = min(size, n - start)
            chunk = torch.zeros(1, size, dtype=torch.long)
            chunk[:, :valid] = ids[:, start : start + valid]
            mask = causal_chunk_mask(self.prefill_layout, self.cache_len, valid)
            positions = chunk_positions(self.prefill_layout, self.cache_len, valid)
            logits, block_kv = self.prefill_step(chunk, positions, self.kv_cache, mask)
            end = self.cache_len + valid
            self.kv_cache[..., self.cache_len : end, :] = block_kv[..., :valid, :]
            self.cache_len = end
            out.append(logits[:, :valid])
        return torch.cat(out, dim=1) if all_logits else out[-1][:, -1]


def _no_grad(fn):
    def step(*inputs):
        with torch.no_grad():
            return fn(*inputs)

    return step


def EagerCacheIO(model: SDARModel, layout: StaticCacheLayout) -> StaticBackend:
    """``SDARModel.forward_export`` in eager mode: the whole cache in and out each step."""
    return StaticBackend(layout, "cache_io", _no_grad(model.forward_export))


def EagerBlockKV(
    model: SDARModel, layout: StaticCacheLayout, prefill_size: int | None = None
) -> StaticBackend:
    """``SDARModel.forward_block_kv`` in eager mode: commit copies block K/V into place;
    with ``prefill_size`` the causal prefill runs in chunks of that many tokens."""
    step = _no_grad(model.forward_block_kv)
    return StaticBackend(layout, "block_kv", step, step if prefill_size else None, prefill_size)


def EagerStaticKV(
    model: SDARModel, layout: StaticCacheLayout, prefill_size: int | None = None
) -> StaticBackend:
    """:class:`~diffulex_edge.export.StaticKVGraph` in eager mode (ExecuTorch's LLM ops on
    torch's CPU): the cache is the graph's buffers; with ``prefill_size`` (block size 1)
    the prompt enters in chunks of up to that many tokens."""
    from diffulex_edge.export import StaticKVGraph

    graph = StaticKVGraph(model, layout.max_seq, layout.block_size).eval()
    step = _no_grad(lambda ids, pos: (graph(ids, pos),))
    return StaticBackend(layout, "static_kv", step, step if prefill_size else None, prefill_size)
