"""CPU-side masks that steer the static graphs.

Key columns of every static attention are ``[cache slot 0 .. max_seq) ++ [block col 0 .. bs)``.
A column is opened only if it holds data this block may see:

- cache slot ``j`` iff ``j < cache_len`` (a committed prompt or frozen-block token; slots at or
  beyond ``cache_len`` are empty or stale and never visible, in iteration or in commit mode);
- block column ``i`` iff ``i < valid_len`` (the block attends bidirectionally to its real tokens;
  padding columns past ``valid_len`` stay hidden).

Rows of padding queries see the same columns as real rows, so no softmax row is empty; their
outputs are never read and never written to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffulex_edge.kv_cache import StaticCacheLayout

HIDDEN = float("-inf")


def _check(layout: StaticCacheLayout, cache_len: int, valid_len: int | None) -> int:
    bs = layout.block_size
    valid = bs if valid_len is None else valid_len
    if not isinstance(valid, int) or not 1 <= valid <= bs:
        raise ValueError(f"valid_len must be in [1, {bs}] (block_size), got {valid_len!r}")
    if not isinstance(cache_len, int) or cache_len < 0:
        raise ValueError(f"cache_len must be a non-negative int, got {cache_len!r}")
    if cache_len + valid > layout.max_seq:
        raise ValueError(
            f"a block of {valid} tokens after cache_len {cache_len} does not fit max_seq "
            f"{layout.max_seq}"
        )
    return valid


def block_attention_mask(
    layout: StaticCacheLayout, cache_len: int, valid_len: int | None = None
) -> torch.Tensor:
    """The additive mask of one block: (batch, 1, bs, max_seq + bs) float, 0 or -inf."""
    valid = _check(layout, cache_len, valid_len)
    bs, max_seq = layout.block_size, layout.max_seq
    row = torch.full((max_seq + bs,), HIDDEN, dtype=layout.dtype)
    row[:cache_len] = 0.0
    row[max_seq : max_seq + valid] = 0.0
    return row.expand(layout.batch, 1, bs, max_seq + bs).contiguous()


def block_positions(layout: StaticCacheLayout, cache_len: int) -> torch.Tensor:
    """Positions of the block that follows ``cache_len`` committed tokens: (batch, bs) int64."""
    _check(layout, cache_len, None)
    return torch.arange(cache_len, cache_len + layout.block_size).expand(layout.batch, -1).clone()


def causal_chunk_mask(layout: StaticCacheLayout, cache_len: int, valid_len: int) -> torch.Tensor:
    """The additive mask of one prefill chunk of an autoregressive model:
    (batch, 1, bs, max_seq + bs) float. Row ``i`` sees the ``cache_len`` committed slots and
    block columns ``0..i``; padding rows (``i >= valid_len``) see what the last real row
    sees, so no row is empty."""
    valid = _check(layout, cache_len, valid_len)
    bs, max_seq = layout.block_size, layout.max_seq
    mask = torch.full((bs, max_seq + bs), HIDDEN, dtype=layout.dtype)
    mask[:, :cache_len] = 0.0
    rows = torch.arange(bs).clamp(max=valid - 1)[:, None]  # (bs, 1)
    block = mask[:, max_seq:]
    block[torch.arange(bs)[None, :] <= rows] = 0.0
    return mask.expand(layout.batch, 1, bs, max_seq + bs).contiguous()


def chunk_positions(layout: StaticCacheLayout, cache_len: int, valid_len: int) -> torch.Tensor:
    """Positions of a prefill chunk: (batch, bs) int64. Padding columns repeat the last real
    position, so no index reaches past the RoPE table however close to max_seq it ends."""
    valid = _check(layout, cache_len, valid_len)
    pos = cache_len + torch.arange(layout.block_size).clamp(max=valid - 1)
    return pos.expand(layout.batch, -1).clone()


@dataclass(frozen=True)
class CacheIOMasks:
    """The three inputs of :meth:`SDARModel.forward_export`.

    attention_mask: (L, B, 1, bs, max_seq + bs); insert_matrix: (L, B, 1, max_seq, bs);
    keep_mask: (L, B, 1, max_seq, 1). All ``layout.dtype``.
    """

    attention_mask: torch.Tensor
    insert_matrix: torch.Tensor
    keep_mask: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.attention_mask, self.insert_matrix, self.keep_mask)
        )


def cache_io_masks(
    layout: StaticCacheLayout, cache_len: int, commit: bool, valid_len: int | None = None
) -> CacheIOMasks:
    """Masks for one step of the cache-as-I/O graph.

    Iteration (``commit=False``): keep every slot, insert nothing.
    Commit: slots ``[cache_len, cache_len + valid_len)`` are zeroed by ``keep_mask`` and
    ``insert_matrix`` maps block column ``i`` to slot ``cache_len + i``; padding columns
    map nowhere.
    """
    valid = _check(layout, cache_len, valid_len)
    L, B, bs, max_seq = layout.num_layers, layout.batch, layout.block_size, layout.max_seq
    attn = block_attention_mask(layout, cache_len, valid)
    insert = torch.zeros(max_seq, bs, dtype=layout.dtype)
    keep = torch.ones(max_seq, 1, dtype=layout.dtype)
    if commit:
        idx = torch.arange(valid)
        insert[cache_len + idx, idx] = 1.0
        keep[cache_len : cache_len + valid] = 0.0
    return CacheIOMasks(
        attention_mask=attn.expand(L, B, 1, bs, max_seq + bs).contiguous(),
        insert_matrix=insert.expand(L, B, 1, max_seq, bs).contiguous(),
        keep_mask=keep.expand(L, B, 1, max_seq, 1).contiguous(),
    )
