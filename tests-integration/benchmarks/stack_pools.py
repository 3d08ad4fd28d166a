"""The stacked row under one device profile, with each pool paired-cache can give it, beside
plain, zstd-linear and paired-cache alone, in one run (#54).

Each row is the demo's, run in a fresh process in its own cgroup by the budget runner
(the profile's hard limit and read bandwidth, the page cache dropped first), rounds
interleaved. The stacked row runs six times: over the gate-less float32 pool of the
paired-cache row, over the zstd pool (each row a zstd frame) and over the grid pool (each
row SmolLM2's Q4_1 codes), each with paired-cache's keep_cached "auto" and 0 (nothing
kept); all six have every
MLP's gate, the attention and the embedding from zstd-linear and the KV cache bounded by
bmrt-kv. Reported per run: tokens/s, the MiB read from storage per decoded token and the
answer.

    hatch run python tests-integration/benchmarks/stack_pools.py [--profile tight] [--rounds R]

Timed: run it on a quiet machine, with nothing mapping files under $MEMBOUND_CACHE.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

MiB = 2**20
COMMAND = "hatch run python tests-integration/benchmarks/stack_pools.py"
RESULTS = Path(__file__).resolve().parents[1] / "results"
ROWS = (  # (rows module, row id, environment of the row's process)
    ("plain", "plain", {}),
    ("zstd_linear", "zstd_linear", {}),
    ("paired_cache", "paired_cache_in_place", {}),
    *(
        ("combined", "combined", {"MEMBOUND_STACK_POOL": pool, "MEMBOUND_STACK_KEEP": keep})
        for pool in ("float32", "zstd", "grid")
        for keep in ("auto", "0")
    ),
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tight")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    from membound_integration.demo import parse_row, row_command, run_prepare
    from membound_testing.budget.cgroup import block_device_of
    from membound_testing.budget.profiles import PROFILES
    from membound_testing.budget.runner import run_limited
    from membound_testing.models import cache_dir
    from membound_testing.results import write_result

    profile = PROFILES[args.profile]
    device = block_device_of(cache_dir())
    run_prepare(sorted({module for module, _, _ in ROWS}))
    from membound_integration.rows.combined import compressed_pool_path

    for codec in ("zstd", "grid"):  # each variant's pool, before any run is timed
        compressed_pool_path(codec)
    runs: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for module, row_id, variant in ROWS:
            env = {**os.environ, **variant}
            result = run_limited(
                row_command(module, row_id),
                profile.memory_bytes,
                profile.read_bps,
                device if profile.read_bps else None,
                timeout=args.timeout,
                env=env,
            )
            row = parse_row(result.stdout) if result.completed else None
            got = {"status": result.status, "row": row, "load": os.getloadavg()[0]}
            label = " ".join(f"{k.split('_')[-1].lower()}={v}" for k, v in variant.items())
            runs.setdefault((row_id, label), []).append(got)
            tps = row["tokens_per_s"] if row else None
            print(f"{row_id} {label}: {result.status} {tps} tok/s", flush=True)

    table = []
    for (row_id, label), got in runs.items():
        done = [g["row"] for g in got if g["row"]]
        name = f"{row_id} ({label})" if label else row_id
        if not done:
            table.append([name, got[0]["status"]] + [""] * 4)
            continue
        tps = statistics.median(r["tokens_per_s"] for r in done)
        per_token = statistics.median(
            r["decode_read_bytes"] / r["new_tokens"] for r in done if r.get("new_tokens")
        )
        table.append(
            [
                done[0]["name"] + (f"; {label}" if label else ""),
                f"{len(done)}/{len(got)} ok",
                round(tps, 3),
                round(per_token / MiB, 1),
                round(profile.read_bps / per_token, 2),
                all(r["correct"] for r in done),
            ]
        )
    loads = [g["load"] for got in runs.values() for g in got]
    write_result(
        RESULTS,
        package="membound",
        name=f"stack_pools_{args.profile}",
        title=f"The stacked row's pools under the {args.profile} profile, beside each package",
        command=COMMAND + ("" if args.profile == "tight" else f" --profile {args.profile}"),
        columns=[
            "row",
            "runs",
            "tok/s (median)",
            "MiB read/token",
            "storage bound tok/s",
            "right answer",
        ],
        rows=table,
        notes=(
            f"{args.profile}: {profile.memory_bytes // MiB} MiB hard limit, "
            f"{(profile.read_bps or 0) / 1e6:.0f} MB/s reads; {args.rounds} round(s), rows "
            f"interleaved; 1-minute load average at the runs' ends "
            f"{min(loads):.2f}-{max(loads):.2f}."
        ),
    )


if __name__ == "__main__":
    main()
