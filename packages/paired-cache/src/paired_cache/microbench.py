"""The update microbenchmark: paired replacement against rebuilding, side by side.

Every method walks the same chain of masks (m active rows out of N; each step swaps k/2
active rows for k/2 inactive ones, so k = |added| + |removed|), interleaved step by step,
and each update is timed alone. Baselines rebuild the whole active set from the same
pre-transposed pools with precomputed indices (their strongest form): torch index_select
and numpy fancy indexing (np.take). The physical limit is this machine's single-thread
memcpy bandwidth, measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from paired_cache.cache import PairedCache
from paired_cache.config import CacheConfig

METHODS = ["paired", "rebuild", "hybrid", "torch_index_select", "numpy_take"]


@dataclass
class BenchConfig:
    """Sizes of the microbenchmark (the issue's: N=8192, hidden=gate=up=1024, m=1024)."""

    n_rows: int = 8192
    hidden: int = 1024
    cols: int = 1024  # gate_cols = up_cols
    m: int = 1024
    ks: tuple[int, ...] = (16, 64, 256, 1024)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    steps: int = 200
    warmup: int = 10  # untimed steps first: thread pools, page faults, caches
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.m <= self.n_rows // 2:
            raise ValueError(f"m must be in [1, N/2={self.n_rows // 2}], got {self.m}")
        for k in self.ks:
            if k < 2 or k % 2 or k // 2 > self.m:
                raise ValueError(f"every k must be even and in [2, 2m={2 * self.m}], got {k}")
        if self.steps < 3:
            raise ValueError(f"steps must be >= 3, got {self.steps}")


def mask_chain(n: int, m: int, k: int, steps: int, seed: int) -> list[torch.Tensor]:
    """steps + 1 (N,) bool masks of m rows; consecutive ones differ in k rows."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(n, m, replace=False)] = True
    chain = [torch.from_numpy(mask.copy())]
    for _ in range(steps):
        out = rng.choice(np.flatnonzero(mask), k // 2, replace=False)
        into = rng.choice(np.flatnonzero(~mask), k // 2, replace=False)
        mask[out], mask[into] = False, True
        chain.append(torch.from_numpy(mask.copy()))
    return chain


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 7) -> float:
    """Single-thread memcpy bandwidth in GB/s (bytes copied per second), median of reps."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)  # numpy copies a contiguous array with one memcpy, one thread
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """The same bytes as a numpy array (numpy has no bfloat16: use int16 then)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def run_one(cfg: BenchConfig, dtype_name: str, k: int, config: CacheConfig):
    """Median microseconds per update, rows moved and bytes moved for each method."""
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(cfg.seed)
    n, h, c = cfg.n_rows, cfg.hidden, cfg.cols
    gate = torch.randn(n, c, generator=gen).to(dtype)
    up = torch.randn(n, c, generator=gen).to(dtype)
    down = torch.randn(h, n, generator=gen).to(dtype)
    chain = mask_chain(n, cfg.m, k, cfg.warmup + cfg.steps, cfg.seed + k)
    indices = [mask.nonzero().squeeze(1) for mask in chain]  # baselines get these for free
    base = config
    caches = {
        name: PairedCache(up, down, gate, capacity=cfg.m, init_mask=chain[0], config=cfg_)
        for name, cfg_ in (
            ("paired", CacheConfig(float("inf"), base.grain, base.par_threshold, base.num_threads)),
            ("rebuild", CacheConfig(0.0, base.grain, base.par_threshold, base.num_threads)),
            ("hybrid", base),
        )
    }
    del gate, up, down
    pools = caches["paired"]
    t_pools = (pools.gate_pool, pools.up_pool, pools.down_pool_T)
    t_out = tuple(torch.empty(cfg.m, p.shape[1], dtype=dtype) for p in t_pools)
    n_pools = tuple(_as_numpy(p) for p in t_pools)
    n_out = tuple(_as_numpy(o) for o in t_out)
    n_indices = [i.numpy() for i in indices]

    def torch_rebuild(i):
        for pool, out in zip(t_pools, t_out, strict=True):
            torch.index_select(pool, 0, indices[i], out=out)

    def numpy_rebuild(i):
        for pool, out in zip(n_pools, n_out, strict=True):
            np.take(pool, n_indices[i], axis=0, out=out)

    run = {name: cache.update for name, cache in caches.items()}
    order_rng = np.random.default_rng(cfg.seed)
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    rows: dict[str, list[int]] = {name: [] for name in METHODS}
    for step in range(1, cfg.warmup + cfg.steps + 1):
        # A fresh order each step: no method always runs first or after the same one (the
        # one before leaves dirty cache lines and, with threads, spinning workers behind).
        for name in order_rng.permutation(METHODS):
            t0 = time.perf_counter_ns()
            if name in run:
                info = run[name](chain[step])
            elif name == "torch_index_select":
                torch_rebuild(step)
            else:
                numpy_rebuild(step)
            elapsed_us = (time.perf_counter_ns() - t0) / 1e3
            if step > cfg.warmup:
                times[name].append(elapsed_us)
                rows[name].append(info.rows_copied if name in run else cfg.m)
    for cache in caches.values():
        cache.check_valid()
    row_bytes = (2 * c + h) * torch.finfo(dtype).bits // 8
    return {
        name: {
            "us": statistics.median(times[name]),
            "rows": statistics.median(rows[name]),
            "bytes": statistics.median(rows[name]) * row_bytes,
        }
        for name in METHODS
    }


def run(cfg: BenchConfig, threads: int, progress=None) -> dict:
    """All (dtype, k) cells plus the memcpy bound; returns columns, rows and summary data.

    threads: the cache's copy threads and torch's intra-op threads alike, so that both
    sides of every comparison get the same cores.
    """
    config = CacheConfig(num_threads=threads)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gbps_before = memcpy_gbps()
        cells = {}
        for dtype_name in cfg.dtypes:
            for k in cfg.ks:
                cells[(dtype_name, k)] = run_one(cfg, dtype_name, k, config)
                if progress is not None:
                    progress(f"threads={threads} {dtype_name} k={k} done")
        gbps = statistics.median([gbps_before, memcpy_gbps()])
    finally:
        torch.set_num_threads(torch_threads)
    columns = [
        "dtype",
        "k",
        "method",
        "median µs/update",
        "speedup vs index_select",
        "rows moved",
        "MB moved",
        "effective GB/s",
        "memcpy bound µs",
        "x bound",
    ]
    table = []
    for (dtype_name, k), cell in cells.items():
        base_us = cell["torch_index_select"]["us"]
        for name in METHODS:
            r = cell[name]
            bound_us = r["bytes"] / (gbps * 1e3)
            table.append(
                [
                    dtype_name,
                    k,
                    name,
                    round(r["us"], 1),
                    round(base_us / r["us"], 2),
                    int(r["rows"]),
                    round(r["bytes"] / 1e6, 3),
                    round(r["bytes"] / (r["us"] * 1e3), 2) if r["us"] else None,
                    round(bound_us, 1),
                    round(r["us"] / bound_us, 2) if bound_us else None,
                ]
            )
    return {"columns": columns, "rows": table, "cells": cells, "memcpy_gbps": gbps}


def markdown(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
