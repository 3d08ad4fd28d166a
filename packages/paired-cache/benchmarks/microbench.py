"""The update microbenchmark: paired replacement against rebuilding, side by side.

Every method walks the same chain of masks (m active rows out of N; each step swaps k/2
active rows for k/2 inactive ones, so k = |added| + |removed|), interleaved step by step,
and each update is timed alone. Baselines rebuild the whole active set with precomputed
indices (their strongest form) from a pool laid out as the cache's own: one pre-transposed
(N, gate + up + hidden) row per neuron, gathered by one torch index_select or numpy fancy
indexing (np.take) into an (m, gate + up + hidden) buffer whose column blocks are the
gate, up and down_T views. The physical limit is measured in the same loop: "memcpy"
moves the bytes of the step's paired update (k/2 rows) as one single-thread memcpy from a
fresh random offset of a source far larger than the last-level cache, into a destination
the size of the active buffers; "memcpy_gather" moves the same bytes as neuron-row-sized
chunks (gate + up + hidden elements, one pool row) from random places of that source
(torch.index_select, one memcpy per chunk): the bound for rows that sit at random places,
as context.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from paired_cache.cache import PairedCache
from paired_cache.config import PairedCacheConfig
from paired_cache.errors import PairedCacheError

METHODS = [
    "paired",
    "rebuild",
    "hybrid",
    "torch_index_select",
    "numpy_take",
    "memcpy",
    "memcpy_gather",
]
COLD_BYTES = 256 << 20  # 8x the 32 MiB L3 of the benchmark machine: DRAM-resident


@dataclass
class BenchConfig:
    """Sizes of the microbenchmark (the issue's: N=8192, hidden=gate=up=1024, m=1024)."""

    n_rows: int = 8192
    hidden: int = 1024
    cols: int = 1024  # gate_cols = up_cols
    m: int = 1024
    # k = 2m replaces every active row: the one k at which rebuilding should win, so that a
    # hybrid rule that never rebuilds is exposed as surely as one that rebuilds too soon.
    ks: tuple[int, ...] = (16, 64, 256, 1024, 2048)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    steps: int = 200
    warmup: int = 10  # untimed steps first: thread pools, page faults, caches
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.m <= self.n_rows // 2:
            raise PairedCacheError(f"m must be in [1, N/2={self.n_rows // 2}], got {self.m}")
        for k in self.ks:
            if k < 2 or k % 2 or k // 2 > self.m:
                raise PairedCacheError(f"every k must be even and in [2, 2m={2 * self.m}], got {k}")
        if self.steps < 3:
            raise PairedCacheError(f"steps must be >= 3, got {self.steps}")


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


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """The same bytes as a numpy array (numpy has no bfloat16: use int16 then)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def run_one(cfg: BenchConfig, dtype_name: str, k: int, config: PairedCacheConfig, cold: np.ndarray):
    """Median microseconds per update, rows moved and bytes moved for each method.

    cold: (COLD_BYTES,) uint8, written once, the memcpy methods' DRAM-resident source.
    """
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
            (
                "paired",
                PairedCacheConfig(float("inf"), base.grain, base.par_threshold, base.num_threads),
            ),
            ("rebuild", PairedCacheConfig(0.0, base.grain, base.par_threshold, base.num_threads)),
            ("hybrid", base),
        )
    }
    # The baselines read a neuron pool of their own (a cache's: the same allocation and
    # interleaved layout, huge pages included): reading the paired cache's pool would warm
    # the very rows that cache adds next and flatter it against the hybrid.
    pools = PairedCache(up, down, gate, capacity=1, config=PairedCacheConfig(num_threads=1))
    del gate, up, down
    t_pool = pools.neuron_pool  # (N, gate + up + hidden)
    # (m, gate + up + hidden): its column blocks [:, :gate + up] and [:, gate + up:] are the
    # rebuilt gate_up and down_T, zero-copy views as the cache's are.
    t_out = torch.empty(cfg.m, t_pool.shape[1], dtype=dtype)
    n_pool, n_out = _as_numpy(t_pool), _as_numpy(t_out)
    n_indices = [i.numpy() for i in indices]

    elem = torch.finfo(dtype).bits // 8
    row_bytes = (2 * c + h) * elem
    copy_rows = k // 2  # what a paired update of this chain moves
    copy_bytes = copy_rows * row_bytes
    active = np.zeros(cfg.m * row_bytes, dtype=np.uint8)  # as large as the active buffers
    chunk = row_bytes  # one neuron's pool row: gate | up | down_T
    n_chunks = -(-copy_bytes // chunk)
    t_cold = torch.from_numpy(cold[: cold.size // chunk * chunk]).view(-1, chunk)
    t_active = torch.from_numpy(active[: n_chunks * chunk]).view(n_chunks, chunk)
    copy_rng = np.random.default_rng(cfg.seed + k)
    steps = cfg.warmup + cfg.steps + 1
    # A fresh random source every step, drawn before timing: a copy never finds its bytes in
    # the cache because an earlier step read them.
    offsets = copy_rng.integers(0, (cold.size - copy_bytes) // 64, size=steps) * 64
    gathers = [
        torch.from_numpy(copy_rng.choice(t_cold.shape[0], n_chunks, replace=False))
        for _ in range(steps)
    ]

    def torch_rebuild(i):
        torch.index_select(t_pool, 0, indices[i], out=t_out)

    def numpy_rebuild(i):
        np.take(n_pool, n_indices[i], axis=0, out=n_out)

    def memcpy(i):
        off = offsets[i]
        np.copyto(active[:copy_bytes], cold[off : off + copy_bytes])  # one memcpy, 1 thread

    def memcpy_gather(i):
        torch.index_select(t_cold, 0, gathers[i], out=t_active)

    run = {name: cache.update for name, cache in caches.items()}
    baselines = {
        "torch_index_select": (torch_rebuild, cfg.m),
        "numpy_take": (numpy_rebuild, cfg.m),
        "memcpy": (memcpy, copy_rows),
        "memcpy_gather": (memcpy_gather, copy_rows),
    }
    order_rng = np.random.default_rng(cfg.seed)
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    rows: dict[str, list[int]] = {name: [] for name in METHODS}
    for step in range(1, steps):
        # A fresh order each step: no method always runs first or after the same one (the
        # one before leaves dirty cache lines and, with threads, spinning workers behind).
        for name in order_rng.permutation(METHODS):
            t0 = time.perf_counter_ns()
            if name in run:
                moved = run[name](chain[step]).rows_copied
            else:
                fn, moved = baselines[name]
                fn(step)
            elapsed_us = (time.perf_counter_ns() - t0) / 1e3
            if step > cfg.warmup:
                times[name].append(elapsed_us)
                rows[name].append(moved)
    for cache in caches.values():
        cache.check_valid()
    cell = {
        name: {
            "us": statistics.median(times[name]),
            "rows": statistics.median(rows[name]),
            "bytes": statistics.median(rows[name]) * row_bytes,
        }
        for name in METHODS
    }
    # The physical limit of this cell: single-thread memcpy bandwidth for these bytes.
    cell["memcpy_gbps"] = copy_bytes / (cell["memcpy"]["us"] * 1e3)
    return cell


def run(cfg: BenchConfig, threads: int, progress=None) -> dict:
    """All (dtype, k) cells with their memcpy bounds; returns columns, rows and summary data.

    threads: the cache's copy threads and torch's intra-op threads alike, so that both
    sides of every comparison get the same cores (memcpy is one thread always).
    """
    config = PairedCacheConfig(num_threads=threads)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cold = np.ones(COLD_BYTES, dtype=np.uint8)
        cells = {}
        for dtype_name in cfg.dtypes:
            for k in cfg.ks:
                cells[(dtype_name, k)] = run_one(cfg, dtype_name, k, config, cold)
                if progress is not None:
                    progress(f"threads={threads} {dtype_name} k={k} done")
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
    # memcpy bound: the row's bytes at the cell's single-thread cold memcpy bandwidth.
    table = []
    for (dtype_name, k), cell in cells.items():
        base_us = cell["torch_index_select"]["us"]
        for name in METHODS:
            r = cell[name]
            # Shown where the row moved the memcpy's bytes: a copy's bandwidth depends on its
            # size, so the cell's memcpy says nothing precise about other sizes.
            same = r["bytes"] == cell["memcpy"]["bytes"]
            bound_us = r["bytes"] / (cell["memcpy_gbps"] * 1e3) if same else None
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
                    round(bound_us, 1) if bound_us else None,
                    round(r["us"] / bound_us, 2) if bound_us else None,
                ]
            )
    return {"columns": columns, "rows": table, "cells": cells}


def markdown(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """python benchmarks/microbench.py [--quick] [--steps S] [--threads T] [--json PATH]:
    one table of updates against rebuilds (update_bench.py writes the README's)."""
    import argparse
    import json
    import os
    import platform
    import sys
    import tempfile

    parser = argparse.ArgumentParser(prog="microbench.py")
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps")
    parser.add_argument("--steps", type=int, default=None, help="updates per cell (default 200)")
    parser.add_argument(
        "--threads", type=int, default=None, help="copy threads and torch threads (default: cores)"
    )
    parser.add_argument("--json", default=None, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    cfg = BenchConfig(steps=args.steps or (20 if args.quick else 200))
    if args.quick:
        cfg = BenchConfig(
            n_rows=2048, hidden=256, cols=256, m=256, ks=(16, 64, 256), steps=cfg.steps
        )
    threads = PairedCacheConfig().num_threads if args.threads is None else args.threads
    result = run(cfg, threads, progress=lambda s: print(s, file=sys.stderr))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(markdown(result["columns"], result["rows"]))
    if args.json:
        payload = {k: result[k] for k in ("columns", "rows")}
        directory = os.path.dirname(os.path.abspath(args.json))
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, args.json)  # never a half-written file
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
