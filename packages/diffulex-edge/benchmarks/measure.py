"""Helpers shared by the benchmark scripts in this folder (not part of the package)."""

from __future__ import annotations

import statistics

import torch

from diffulex_edge.kv_cache import StaticCacheLayout


def interleaved_median(runs: dict, rounds: int) -> dict[str, list]:
    """Call each ``runs[name]()`` once per round, in turn (A B A B ...); all results kept."""
    out: dict[str, list] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            out[name].append(fn())
    return out


def median(values) -> float:
    return statistics.median(values)


def step_bytes(layout: StaticCacheLayout, vocab_size: int, variant: str) -> dict[str, int]:
    """Bytes one denoising step moves across the graph boundary, besides the cache read.

    Both graphs read the committed cache to attend (``cache_read``, the same for both); what
    differs is what the host must build and what the graph must write:
    ``cache_io`` writes the whole updated cache and takes three per-layer masks;
    ``block_kv`` takes one shared mask and writes only the block's K/V.
    """
    f = torch.empty((), dtype=layout.dtype).element_size()
    L, bs, max_seq = layout.num_layers, layout.block_size, layout.max_seq
    ids = 2 * bs * 8  # input_ids + positions, int64
    logits = bs * vocab_size * 4
    cache = layout.nbytes
    block_kv = L * 2 * layout.kv_heads * bs * layout.head_dim * f
    if variant == "cache_io":
        masks = L * (bs * (max_seq + bs) + max_seq * bs + max_seq) * f
        moved = ids + masks + logits + cache
    elif variant == "block_kv":
        masks = bs * (max_seq + bs) * f
        moved = ids + masks + logits + block_kv
    else:
        raise ValueError(f"variant must be 'cache_io' or 'block_kv', got {variant!r}")
    return {"moved": moved, "masks": masks, "cache_read": cache}
