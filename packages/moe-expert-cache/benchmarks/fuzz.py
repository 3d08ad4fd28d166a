"""Mutation fuzzing of every moe-expert-cache loader: thousands of seeded mutants per
loader, each batch loaded in a fresh process, classed clean / unclear / crash / hang /
silent / benign (membound_testing.fuzz). Writes results/fuzz.json.

    python benchmarks/fuzz.py [--mutants 2000] [--seed 2026] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from membound_testing import fuzz as mutation_fuzz
from membound_testing.results import write_result

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import fuzz_checkers  # noqa: E402  (lives with the tests, which run the same loaders)

RESULTS = Path(__file__).parent / "results"
FOREIGN_CONFIG = "load_cached_model (config.json without integrity record)"


def run(mutants: int = 2000, seed: int = 2026, quick: bool = False) -> dict:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p
    )
    columns = ["loader", "mutants", "clean", "unclear", "crash", "hang", "silent", "benign", "s"]
    rows, targets = [], []
    with tempfile.TemporaryDirectory(prefix="moe-fuzz-refs-") as tmp:
        refs = fuzz_checkers.make_references(Path(tmp))
        os.environ["MOE_FUZZ_REFS"] = str(refs)
        loaders = fuzz_checkers.loaders(refs)
        loaders[FOREIGN_CONFIG] = fuzz_checkers.foreign_config(refs)
        for name, (target_list, checker) in loaders.items():
            start = time.perf_counter()
            report = mutation_fuzz.run(
                target_list, checker, fuzz_checkers.CLEAN_ERRORS, n=mutants, seed=seed
            )
            seconds = time.perf_counter() - start
            print(f"{name}: {report.summary()}", flush=True)
            c = report.counts
            rows.append([name, mutants, *(c[k] for k in mutation_fuzz.CLASSES), round(seconds, 1)])
            measured = ", ".join(f"{c[k]} {k}" for k in mutation_fuzz.BAD)
            if name == FOREIGN_CONFIG:
                target = "0 crash, 0 hang, 0 unclear (a file the package did not write: silent is the documented limit)"
                met = not any(c[k] for k in ("crash", "hang", "unclear"))
            else:
                target = "0 crash, 0 hang, 0 unclear, 0 silent where the package wrote the file"
                if "without integrity record" in name:
                    target += (
                        " (foreign shards: a changed weight payload counts as benign, see Limits)"
                    )
                met = not report.bad
            targets.append({"target": f"{name}: {target}", "measured": measured, "met": met})
    notes = (
        f"Seed {seed}; {mutants} mutants per loader, about half byte-level (truncation, flips "
        "anywhere and in the header, zeroed ranges, appended junk, duplicated ranges) and half "
        "structured (safetensors / JSON header fields rewritten with the length prefix kept; "
        "warm-start states and router traces rewritten and re-sealed with a recomputed "
        "SHA-256). Model: random 4-bit Qwen3-MoE, 2 layers, 8 experts, top-2, 2 shards, as "
        "written by write_random_moe (sealed with an integrity record) and the same files "
        "without the record. Batches of 50 mutants per fresh process, 60 s batch timeout, "
        "20 s per mutant for a re-run. clean = ExpertCacheError; unclear = any other exception."
    )
    return write_result(
        RESULTS,
        package="moe-expert-cache",
        name="fuzz",
        title="damaged and crafted input, per loader (mutation fuzzing)",
        command=f"python benchmarks/fuzz.py --mutants {mutants} --seed {seed}",
        columns=columns,
        rows=rows,
        targets=targets,
        notes=notes,
        save=not quick,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=2000, help="mutants per loader")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--quick", action="store_true", help="100 mutants, nothing written")
    args = parser.parse_args()
    run(100 if args.quick else args.mutants, args.seed, args.quick)


if __name__ == "__main__":
    main()
