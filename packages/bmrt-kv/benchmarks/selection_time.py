"""LSH vs exact selection time for one layer at B=1024, block 512 (SmolLM2-135M shapes).

Both selectors rank the same pool (B + block tokens, 3 KV heads of 64 dims, 3 query
heads per KV head); runs are interleaved A B A B and the medians compared. The SDPA
attention of the same block over the same pool is timed alongside as the floor a
selector is paid against (the work the forward does anyway).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from common import write_result

from bmrt_kv import make_selector
from bmrt_kv.selectors import Pool


def make_pool(budget: int, block: int, kv_heads=3, groups=3, head_dim=64, seed=0) -> Pool:
    gen = torch.Generator().manual_seed(seed)
    p = budget + block
    positions = torch.arange(p).view(1, 1, p).expand(1, kv_heads, p).contiguous()
    candidates = torch.ones(1, kv_heads, p, dtype=torch.bool)
    candidates[..., : budget // 8] = False
    candidates[..., p - budget // 8 :] = False
    return Pool(
        keys=torch.randn(1, kv_heads, p, head_dim, generator=gen),
        positions=positions,
        queries=torch.randn(1, kv_heads, groups * block, head_dim, generator=gen),
        query_positions=torch.arange(p - block, p).repeat(groups),
        candidates=candidates,
        query_groups=groups,
    )


def _measure(variants, pool, k, attention, repeats) -> dict[str, float]:
    runs = {name: [] for name in variants} | {"block attention (SDPA)": []}
    for _ in range(2):  # warm-up
        for selector in variants.values():
            selector.select(pool, k)
    for _ in range(repeats):
        for name, selector in variants.items():
            start = time.perf_counter()
            selector.select(pool, k)
            runs[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        attention()
        runs["block attention (SDPA)"].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in runs.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    budget, block = 1024, 512
    pool = make_pool(budget, block)
    k = budget - 2 * (budget // 8)
    variants = {
        "exact": make_selector("exact"),
        "lsh (l2)": make_selector("lsh", {"tie_breaker": "l2"}),
        "lsh (none)": make_selector("lsh", {"tie_breaker": "none"}),
        "lsh (partitioned_centroid)": make_selector("lsh", {"tie_breaker": "partitioned_centroid"}),
        "lsh (max_sim)": make_selector("lsh", {"tie_breaker": "max_sim"}),
        "magicpig": make_selector("magicpig"),
    }
    q = pool.queries.view(1, 3, 3, block, 64).reshape(1, 9, block, 64)
    kv = pool.keys.repeat_interleave(3, dim=1)

    def attention():
        F.scaled_dot_product_attention(q, kv, kv)

    repeats = 5 if args.quick else 21
    load_start = os.getloadavg()[0]
    rows, ratios = [], {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        medians = _measure(variants, pool, k, attention, repeats)
        exact = medians["exact"]
        rows += [
            [threads, name, round(1e3 * m, 2), round(m / exact, 3)] for name, m in medians.items()
        ]
        ratios[threads] = (medians["lsh (l2)"] / exact, medians["lsh (none)"] / exact)
    targets = [
        {
            "target": "LSH selection time <= 25% of exact at B=1024, block 512",
            "measured": "lsh (l2) / exact = "
            + ", ".join(f"{r[0]:.0%} ({t} thread{'s' * (t > 1)})" for t, r in ratios.items())
            + "; tie-breaker none: "
            + ", ".join(f"{r[1]:.0%}" for r in ratios.values()),
            "met": all(r[0] <= 0.25 for r in ratios.values()),
        }
    ]
    write_result(
        "selection_time",
        "Selection time per layer, B=1024, block 512, SmolLM2 shapes (median ms)",
        ["threads", "selector", "median ms", "vs exact"],
        rows,
        targets,
        f"{repeats} interleaved repeats at 1 and 2 torch threads; one layer (3 KV heads x 64 dims, 3 query "
        "heads per KV head); random tensors (the cost does not depend on the values). "
        f"1-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
        "end (2 cores).",
    )


if __name__ == "__main__":
    main()
