"""Measurements shared by ``diffulex-edge bench`` and ``benchmarks/run_all.py``."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from diffulex_edge.backends import Backend
from diffulex_edge.generate import GenerationConfig, generate
from diffulex_edge.kv_cache import StaticCacheLayout
from diffulex_edge.task import SortTask


@dataclass
class DecodeRun:
    tokens_per_s: float
    tokens_per_forward: float
    tokens_per_forward_with_commits: float
    exact_match: float


def run_sort_task(
    backend: Backend, prompts: list[list[int]], config: GenerationConfig, mask_id: int, eos_id: int
) -> DecodeRun:
    """Decode every prompt; tokens/s counts decoded tokens over wall time, prefill included."""
    task = SortTask()
    decoded = denoise = commits = correct = 0
    start = time.perf_counter()
    for prompt in prompts:
        r = generate(backend, prompt, config, mask_id, eos_id)
        decoded += r.decoded_tokens
        denoise += r.denoise_forwards
        commits += r.commit_forwards
        correct += r.tokens == task.expected(prompt)
    seconds = time.perf_counter() - start
    return DecodeRun(
        tokens_per_s=decoded / seconds,
        tokens_per_forward=decoded / max(denoise, 1),
        tokens_per_forward_with_commits=decoded / max(denoise + commits, 1),
        exact_match=correct / len(prompts),
    )


def sort_prompts(n: int, seed: int = 1234) -> list[list[int]]:
    task = SortTask()
    seqs = task.sample(n, torch.Generator().manual_seed(seed))
    return [s[: task.prompt_len].tolist() for s in seqs]


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
