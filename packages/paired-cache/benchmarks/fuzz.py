"""Argument fuzzing at scale: thousands of seeded PairedCache argument mutants (issue #15).

hatch run paired-cache:python packages/paired-cache/benchmarks/fuzz.py [--mutants 2000] [--seed 15] [--quick]

The mutants, the spec and the checker are the test suite's (tests/args_fuzz.py): one
field of three good scenarios (weights, capacity, CacheConfig, initial mask, updates)
rewritten to an odd value, a nearby int, a shortened list, deleted, or a key added; each
scenario constructs a PairedCache and runs its updates, in batches of fresh processes.
Writes results/fuzz.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

import args_fuzz  # noqa: E402

from membound_testing import fuzz  # noqa: E402
from membound_testing.results import write_result  # noqa: E402

COLUMNS = ["loader", "mutants", "clean", "unclear", "crash", "hang", "silent", "benign", "s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=2000, help="mutants per loader")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument(
        "--quick", action="store_true", help="400 mutants, results not saved (run_all --quick)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.mutants = 400
    # The worker processes import the checker from the tests directory.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        target = fuzz.Target(
            root=args_fuzz.write_targets(Path(tmp)),
            structured=fuzz.mutate_json_bytes,
            structured_share=1.0,
        )
        start = time.perf_counter()
        report = fuzz.run(
            [target],
            "args_fuzz:check",
            ["paired_cache.PairedCacheError"],
            n=args.mutants,
            seed=args.seed,
            batch=250,
            timeout=600,
        )
        seconds = time.perf_counter() - start
    print(report.summary())
    counts = [report.counts[c] for c in fuzz.CLASSES]
    loader = "PairedCache constructor + update (3 scenarios: weights, capacity, config, masks)"
    bad = ", ".join(f"{report.counts[c]} {c}" for c in ("crash", "hang", "unclear", "silent"))
    write_result(
        HERE / "results",
        package="paired-cache",
        name="fuzz",
        title=f"Argument fuzzing, {args.mutants} seeded mutants, seed {args.seed}",
        command=(
            "hatch run paired-cache:python packages/paired-cache/benchmarks/fuzz.py "
            f"--mutants {args.mutants} --seed {args.seed}"
        ),
        columns=COLUMNS,
        rows=[[loader, args.mutants, *counts, round(seconds, 1)]],
        targets=[
            {
                "target": "0 crash, 0 hang, 0 unclear, 0 silent where the package wrote the file",
                "measured": f"{loader}: {bad}",
                "met": not report.bad,
            }
        ],
        save=not args.quick,
        notes=(
            "The package reads no file; a mutant is a JSON describing the constructor and "
            "update arguments with one field rewritten (fuzz.ODD_VALUES, a nearby int, "
            "deleted, a key added); a description the harness cannot build is passed as the "
            "raw JSON value. clean: PairedCacheError, an independent spec "
            "(tests/args_fuzz.py) agrees the argument is invalid, and a refused update left "
            "the cache unchanged; unclear: any other exception, or a valid argument refused; "
            "silent: an invalid argument accepted, a refused update that changed the cache, "
            "or a cache holding other than what was asked (pools, mask, capacity, config); "
            "benign: accepted, and the cache holds exactly what was asked."
        ),
    )
    return 1 if report.bad else 0


if __name__ == "__main__":
    sys.exit(main())
