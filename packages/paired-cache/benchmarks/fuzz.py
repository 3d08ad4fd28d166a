"""Argument fuzzing at scale: thousands of seeded PairedCache argument mutants (issue #15).

hatch run paired-cache:python packages/paired-cache/benchmarks/fuzz.py [--mutants 2000] [--seed 15] [--quick]

The mutants, the spec and the checker are the test suite's (tests/args_fuzz.py): one
field of three good scenarios (weights, capacity, PairedCacheConfig, initial mask, updates)
rewritten to an odd value, a nearby int, a shortened list, deleted, or a key added; each
scenario constructs a PairedCache and runs its updates, in batches of fresh processes.
Writes results/fuzz.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import args_fuzz  # noqa: E402

from membound_testing import fuzz  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return fuzz.json_benchmark(
        argv,
        doc=__doc__,
        tests_dir=TESTS,
        write_targets=args_fuzz.write_targets,
        checker="args_fuzz:check",
        clean_errors=["paired_cache.PairedCacheError"],
        package="paired-cache",
        loader="PairedCache constructor + update (3 scenarios: weights, capacity, config, masks)",
        title="Argument fuzzing",
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


if __name__ == "__main__":
    sys.exit(main())
