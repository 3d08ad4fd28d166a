"""The RULER-style suite (ruler_suite.py) on SmolLM2-135M-Instruct: selectors x budgets x
scoring modes against the full cache, per task and length, exact match.

The full protocol of #18 is 4k and 8k tokens, 20 samples per task and length, B = 256 /
512 / 1024: on this 2-core CPU that is many hours per configuration, so the flags choose a
subset and the JSON says exactly what ran. Rows are written after every configuration, so
a cut-off run keeps what it measured.

    hatch run bmrt-kv:python packages/bmrt-kv/benchmarks/suite.py \\
        --lengths 4000 --samples 5 --budgets 1024 --selectors full keydiff snapkv
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
from common import add_run_flags, earlier_result, run_config, runs, write_result
from evaluation import run_sample
from ruler_suite import TASKS, suite_samples

from bmrt_kv import SELECTORS
from bmrt_kv.config import DEFAULT_BLOCK_SIZE

COLUMNS = ["tokens", "task", "selector", "B", "scoring", "correct", "peak KV MiB", "s/sample"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4000, 8000])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument(
        "--selectors", nargs="+", default=["full", *SELECTORS], choices=["full", *SELECTORS]
    )
    parser.add_argument(
        "--scorings",
        nargs="+",
        default=["agnostic", "query_aware"],
        choices=["agnostic", "query_aware"],
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per block (default: the config's, min(512, B), query-aware "
        "min(512, 2B); a row's label shows a block other than 512)",
    )
    add_run_flags(parser)
    parser.add_argument("--name", default="suite", help="results/<name>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from membound_testing import load_smollm2

    model, tokenizer = load_smollm2()
    load_start = os.getloadavg()[0]
    earlier = earlier_result(args.name, args.append)
    rows = earlier["rows"] if earlier else []
    plan = runs(args.selectors, args.budgets, args.scorings)
    for n_tokens in args.lengths:
        by_task = suite_samples(tokenizer, n_tokens, args.samples, args.seed, args.tasks)
        for task, samples in by_task.items():
            for selector, budget, scoring in plan:
                config, selector_label, scoring_label = run_config(
                    args, selector, budget, scoring, args.block_size
                )
                start = time.perf_counter()
                results = [
                    run_sample(model, tokenizer, s, config, args.block_size or DEFAULT_BLOCK_SIZE)
                    for s in samples
                ]
                row = [
                    n_tokens,
                    task,
                    selector_label,
                    budget or "-",
                    scoring_label,
                    f"{sum(r['correct'] for r in results)}/{len(results)}",
                    round(max(r["peak_kv_bytes"] for r in results) / 2**20, 1),
                    round((time.perf_counter() - start) / len(results), 1),
                ]
                rows.append(row)
                print(row, repr(results[0]["output"][:60]), flush=True)
                _write(args, argv, rows, load_start, earlier)


def _write(args, argv, rows, load_start, earlier=None) -> None:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    flags = sys.argv[1:] if argv is None else argv
    write_result(
        args.name,
        f"RULER-style suite, SmolLM2-135M, greedy, exact match: {args.samples} samples per "
        "task and length",
        COLUMNS,
        rows,
        [],
        command=(earlier["command"] + " ; then " if earlier else "")
        + "hatch run bmrt-kv:python packages/bmrt-kv/benchmarks/suite.py "
        + " ".join(flags),
        notes=(earlier["notes"] + " THEN (--append) " if earlier else "")
        + f"Ran: lengths {args.lengths}, tasks {args.tasks}, {args.samples} samples, "
        f"budgets {args.budgets}, selectors {args.selectors}, scorings {args.scorings}, "
        f"seed {args.seed}; "
        + (f"kernel {args.kernel}, " if args.kernel is not None else "")
        + (f"lsh tie-breaker {args.tie_breaker}, " if args.tie_breaker is not None else "")
        + (f"question weight {args.question_weight}, " if args.question_weight != 0.5 else "")
        + (
            f"keydiff question share {args.question_share}, "
            if args.question_share is not None
            else ""
        )
        + (f"keydiff anchor {args.anchor}, " if args.anchor is not None else "")
        + (f"block {args.block_size}, " if args.block_size is not None else "")
        + "other options at their defaults. Peak RSS of the run "
        f"{rss / 2**20:.0f} MiB. 1-minute load average {load_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the last row (2 cores): s/sample is context only.",
    )


if __name__ == "__main__":
    main()
