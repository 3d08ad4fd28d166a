"""Tokens/s of the in-place model near the hard limit where its working set stops fitting:
the budget runner's row (prompt, then 24 greedy tokens, timed after a two-token warm-up),
at a list of hard limits around its `mid` profile (900 MiB, 500 MB/s reads), with the C
core's row selection (0.14.1's default) and with torch's (`top_k_rows(core=False)`, 0.14.0's
default), beside the plain mmap'd model; each run a fresh process in its own cgroup after
the page cache was dropped, interleaved over rounds.

    hatch run python tests-integration/benchmarks/limit_sweep.py [--limits MiB ...]
        [--rounds R]

Near that edge the model's pages and the libraries' share what the limit leaves, and which
pages the kernel's LRU evicts during the first tokens decides whether the timed tokens
re-read hundreds of MiB: this measures how much the row's figure moves with the limit and
the selection. Runs in the default environment (the integration package's runner and
rows); timed: run it on a quiet machine, with nothing mapping files under $MEMBOUND_CACHE.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

MiB = 2**20
COMMAND = "hatch run python tests-integration/benchmarks/limit_sweep.py"
# The runner's paired-cache rows are paired-cache's to report: its RESULTS.md renders this.
RESULTS = (
    Path(__file__).resolve().parents[2] / "packages" / "paired-cache" / "benchmarks" / "results"
)
MODES = ("plain", "core", "torch")
LABELS = {
    "plain": "plain mmap'd model (transformers)",
    "core": "in place 50%, C selection (0.14.1)",
    "torch": "in place 50%, torch selection (0.14.0)",
}
MARK = "RESULT "


def child(mode: str) -> None:
    """Run the budget runner's row for `mode`; print one JSON line."""
    if mode == "plain":
        from membound_integration.rows.plain import plain_model as row_fn
    else:
        if mode == "torch":
            from paired_cache import mask_sources

            mask_sources.top_k_rows.__kwdefaults__["core"] = False  # what the sources call
        from membound_integration.rows.paired_cache import paired_cache_in_place_row as row_fn
    row = row_fn()
    print(
        MARK
        + json.dumps(
            {
                "tok_s": row.tokens_per_s,
                "read": row.decode_read_bytes,
                "tokens": row.new_tokens,
                "correct": row.correct,
            }
        ),
        flush=True,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limits", type=int, nargs="+", default=[860, 880, 900, 920, 940, 960])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return
    if min(args.limits) < 1 or args.rounds < 1:
        parser.error("limits and rounds must be >= 1")

    from membound_integration.rows.paired_cache import pool_path, predictor_path
    from membound_testing import smollm2_float_dir
    from membound_testing.budget.cgroup import block_device_of
    from membound_testing.budget.profiles import PROFILES
    from membound_testing.budget.runner import run_limited
    from membound_testing.models import cache_dir
    from membound_testing.results import write_result

    smollm2_float_dir(), pool_path(), predictor_path()  # made outside the limit
    read_bps = PROFILES["mid"].read_bps
    device = block_device_of(cache_dir())
    load = [os.getloadavg()[0]]
    runs: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.rounds):
        for limit in args.limits:
            for mode in MODES:
                command = [sys.executable, __file__, "--child", mode]
                result = run_limited(command, limit * MiB, read_bps, device, timeout=300)
                lines = [ln for ln in result.stdout.splitlines() if ln.startswith(MARK)]
                run = json.loads(lines[-1][len(MARK) :]) if lines else None
                if result.returncode != 0 or run is None:
                    run = {"failed": f"exit {result.returncode}"}
                runs.setdefault((limit, mode), []).append(run)
                print(limit, mode, run, flush=True)
    load.append(os.getloadavg()[0])

    rows = []
    for limit in args.limits:
        for mode in MODES:
            done = [r for r in runs[(limit, mode)] if "failed" not in r]
            failed = [r["failed"] for r in runs[(limit, mode)] if "failed" in r]
            rows.append(
                [
                    limit,
                    LABELS[mode],
                    " / ".join(f"{r['tok_s']:.2f}" for r in done) or "-",
                    round(statistics.median(r["tok_s"] for r in done), 2) if done else "-",
                    " / ".join(f"{r['read'] / MiB:.0f}" for r in done) or "-",
                    f"{sum(r['correct'] for r in done)}/{len(done)}"
                    + (f" ({', '.join(failed)})" if failed else ""),
                ]
            )
    write_result(
        RESULTS,  # paired-cache's: its RESULTS.md renders the table
        package="paired-cache",
        name="limit_sweep",
        command=COMMAND,
        title="The budget runner's in-place row near its working set's edge: SmolLM2-135M "
        f"float32, trained predictor at 50%, reads throttled to {read_bps // 10**6} MB/s, "
        f"{args.rounds} interleaved rounds",
        columns=[
            "hard limit MiB",
            "model",
            "tokens/s per round",
            "median",
            "MiB read while timed, per round",
            "answers right",
        ],
        rows=rows,
        targets=[],
        notes="Each run is a fresh process (torch's default threads, as the budget runner's "
        "rows) in its own cgroup with the hard limit and the read throttle, after the page "
        "cache was dropped (membound_testing.budget.runner.run_limited). tokens/s and "
        "reads are the runner's row's: prompt (dense) and 24 greedy tokens, timed after a "
        "two-token warm-up. The torch rows set top_k_rows' default to core=False in the "
        f"child. 1-minute load average {load[0]:.1f} at the start and {load[1]:.1f} at the "
        "end (2 cores).",
    )


if __name__ == "__main__":
    main()
