"""Mutation fuzzing of diffulex-edge's loaders (issue #15): ``python benchmarks/fuzz.py``.

For each file a loader reads, ``--mutants`` seeded mutants (byte mutations, plus structured
ones: flips in the first 64 bytes of the ``.pte``, JSON field rewrites of the records and
config, safetensors header rewrites) are loaded in batches of fresh processes by the test
suite's checkers (``tests/fuzz_checkers.py``) and classed clean / unclear / crash / hang /
silent / benign. Loaders: ``PteEngine`` (verification on) on a tiny exported ``block_kv``
program and its record; ``load_checkpoint`` on a checkpoint written by ``save_checkpoint``
(with its integrity record) and on the same checkpoint without the record (as a foreign
Hugging Face checkpoint comes, where silent changes are expected: README Limits).
Writes ``results/fuzz.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from diffulex_edge.config import tiny_config
from diffulex_edge.export import export_pte
from membound_testing import fuzz
from membound_testing.results import write_result

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

from fuzz_checkers import checkpoint_targets, pte_targets  # noqa: E402
from random_sdar import random_model  # noqa: E402  (benchmarks/, the script's folder)

CLEAN = ["diffulex_edge.DiffulexEdgeError"]
COLUMNS = ["loader", "file", "mutants", "clean", "unclear", "crash", "hang", "silent", "benign"]


def run_target(name, target, checker, n, seed, batch):
    t0 = time.perf_counter()
    report = fuzz.run([target], checker, CLEAN, n, seed, batch=batch)
    print(f"{name}: {report.summary()} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=2000, help="mutants per file")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--batch", type=int, default=500, help="mutants per worker process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p
    )
    model = random_model(tiny_config(), seed=0)
    rows, targets, reached_bad, reached_total = [], [], 0, 0
    with tempfile.TemporaryDirectory(prefix="diffulex-fuzz-") as tmp:
        tmp = Path(tmp)
        pte = export_pte(model, tmp / "tiny.pte", 64, 4, "block_kv").path
        runs = [("PteEngine", "fuzz_checkers:check_pte", pte_targets(pte, tmp / "pte"))]
        for foreign in (False, True):
            runs.append(
                (
                    "load_checkpoint" + (" (foreign: no record)" if foreign else ""),
                    "fuzz_checkers:check_checkpoint",
                    checkpoint_targets(model, tmp / f"ckpt-{foreign}", foreign),
                )
            )
        for loader, checker, files in runs:
            original = next(iter(files.values())).root
            os.environ["DIFFULEX_FUZZ_ORIGINAL"] = str(original)
            reach_log = tmp / f"reached-{len(rows)}.jsonl"
            os.environ["DIFFULEX_FUZZ_REACH_LOG"] = str(reach_log)
            totals = dict.fromkeys(fuzz.CLASSES, 0)
            for name, target in files.items():
                report = run_target(
                    f"{loader} {name}", target, checker, args.mutants, args.seed, args.batch
                )
                counts = [report.counts[c] for c in fuzz.CLASSES]
                rows.append([loader, name, args.mutants, *counts])
                for c in fuzz.CLASSES:
                    totals[c] += report.counts[c]
            bad = {c: totals[c] for c in ("crash", "hang", "unclear", "silent")}
            n = args.mutants * len(files)
            if loader.startswith("PteEngine"):
                lines = reach_log.read_text().splitlines() if reach_log.exists() else []
                reached = [json.loads(line) for line in lines]
                # Each fuzz.run first loads the unmutated files once (pristine).
                reached_total = len(reached) - len(files)
                reached_bad = sum(not r["pristine"] for r in reached)
            if "foreign" in loader:
                want = {c: v for c, v in bad.items() if c != "silent"}
                targets.append(
                    {
                        "target": f"{loader}: 0 crash, 0 hang, 0 unclear over {n} mutants "
                        "(no integrity record: silent is counted, not a target)",
                        "measured": ", ".join(f"{c} {v}" for c, v in bad.items()),
                        "met": not any(want.values()),
                    }
                )
            else:
                targets.append(
                    {
                        "target": f"{loader}: 0 crash, 0 hang, 0 unclear, 0 silent where the "
                        f"package wrote the file, over {n} mutants",
                        "measured": ", ".join(f"{c} {v}" for c, v in bad.items()),
                        "met": not any(bad.values()),
                    }
                )
    targets.append(
        {
            "target": "PteEngine (verification on): 0 damaged mutants reach ExecuTorch's loader",
            "measured": f"{reached_bad} damaged; {reached_total} content-identical records "
            "reached it (verified program)",
            "met": reached_bad == 0,
        }
    )
    write_result(
        HERE / "results",
        package="diffulex-edge",
        name="fuzz",
        title="loaders under seeded mutation (issue #15)",
        command=f"python benchmarks/fuzz.py --mutants {args.mutants} --seed {args.seed}",
        columns=COLUMNS,
        rows=rows,
        targets=targets,
        notes=(
            f"seed {args.seed}, {args.mutants} mutants per file, about half structured "
            "(.pte: 1-3 flips in bytes 0-64, half inside the ET12 identifier; records and "
            "config.json: one JSON field rewritten, deleted or added; model.safetensors: one "
            "header field rewritten with the length prefix kept right), half byte-level "
            "(truncation, flips anywhere and in the first 64 bytes, zeroed ranges, appended "
            "junk, duplicated ranges). Each batch runs in a fresh process; a hang is > 20 s. "
            "A .pte mutant 'reaches ExecuTorch' if the load_program of the runtime "
            "PteEngine loads through is called while it is opened. The foreign rows load "
            "the same checkpoint without diffulex_integrity.json: a flipped weight byte or a "
            "config value changed to another valid one cannot be detected there."
        ),
    )


if __name__ == "__main__":
    main()
