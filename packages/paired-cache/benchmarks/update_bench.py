"""The update microbenchmark (issue 3, item 8) at 1 thread and at all cores, with targets."""

from __future__ import annotations

import sys

from common import NOISE, write_result
from microbench import COLD_BYTES, BenchConfig, run

from paired_cache.config import PairedCacheConfig


def targets_for(result: dict, label: str) -> list[dict]:
    cells = result["cells"]
    out = []
    for k, want in ((16, 5.0), (64, 3.0)):
        if ("float32", k) not in cells:
            continue
        c = cells[("float32", k)]
        speedup = c["torch_index_select"]["us"] / c["hybrid"]["us"]
        out.append(
            {
                "target": f"{label}: float32 with gate, k={k}: cache update >= {want:g}x faster "
                "than the fair index_select rebuild",
                "measured": f"{speedup:.1f}x ({c['hybrid']['us']:.0f} µs vs "
                f"{c['torch_index_select']['us']:.0f} µs)",
                "met": speedup >= want,
            }
        )
    worst = []
    for (dtype, k), c in cells.items():
        if k >= 256:
            for name in ("paired", "hybrid"):
                bound = c[name]["bytes"] / (c["memcpy_gbps"] * 1e3)
                where = f"{dtype} k={k} {name}; memcpy {c['memcpy_gbps']:.1f} GB/s"
                worst.append((c[name]["us"] / bound, where))
    if worst:
        ratio, where = max(worst)
        out.append(
            {
                "target": f"{label}: k >= 256: time per update <= 2x the memcpy bound "
                "(bytes moved / the cell's single-thread cold memcpy GB/s)",
                "measured": f"worst {ratio:.2f}x ({where})",
                "met": ratio <= 2.0,
            }
        )
    slow = []
    for (dtype, k), c in cells.items():
        best = min(c["paired"]["us"], c["rebuild"]["us"])
        slow.append((c["hybrid"]["us"] / best, f"{dtype} k={k}"))
    ratio, where = max(slow)
    out.append(
        {
            "target": f"{label}: hybrid never more than 10% slower than the better of paired "
            "and rebuild, at every k",
            "measured": f"worst hybrid / best = {ratio:.2f} ({where})",
            "met": ratio <= 1.10,
        }
    )
    return out


BOUND_NOTES = (
    "memcpy bound: in the same interleaved loop, 'memcpy' moves the bytes of the step's "
    "paired update (k/2 rows) with one single-thread memcpy (numpy copyto) from a fresh "
    f"random offset of a {COLD_BYTES >> 20} MiB source (8x the 32 MiB L3, so from DRAM) into "
    "a buffer the size of the active rows; an update's bound is its bytes moved / that "
    "cell's memcpy GB/s. 'memcpy_gather' moves the same bytes as neuron-row-sized chunks "
    "(one pool row: gate | up | down_T) from random places of that source "
    "(torch.index_select, one memcpy per chunk): the cost of the random placement alone, as "
    "context. The pool and the active rows sit on transparent huge pages where the kernel "
    "grants them."
)


def main(quick: bool) -> None:
    cfg = BenchConfig()
    if quick:
        cfg = BenchConfig(n_rows=2048, hidden=256, cols=256, m=256, ks=(16, 64, 256, 512), steps=20)
    all_cores = PairedCacheConfig().num_threads
    for threads in sorted({1, all_cores}):
        result = run(cfg, threads, progress=lambda s: print(s, file=sys.stderr))
        label = f"{threads} thread{'s' if threads > 1 else ''}"
        write_result(
            f"update_{threads}t",
            f"Cache update vs rebuild, N={cfg.n_rows}, hidden=gate=up={cfg.cols}, m={cfg.m}, "
            f"{label} (cache copies and torch alike)",
            result["columns"],
            result["rows"],
            targets_for(result, label),
            NOISE + f" {cfg.steps} updates per cell, interleaved, medians. k = |added| + "
            "|removed| (k/2 of each; k = 2m replaces every row); baselines get precomputed "
            "indices and a neuron pool of their own in the cache's layout (one (N, gate + up + "
            "hidden) row per neuron, one index_select / np.take per rebuild); hybrid uses the "
            f"default tau = {PairedCacheConfig().hybrid_tau:g} (rebuild "
            "when k > tau * m, m the mean of the active rows before and after). " + BOUND_NOTES,
            save=not quick,
        )


if __name__ == "__main__":
    main("--quick" in sys.argv)
