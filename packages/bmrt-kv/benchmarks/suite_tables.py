"""bmrt-kv and kvpress side by side on the RULER-style suite: one table per scoring mode.

Reads what ``suite.py`` (bmrt-kv) and ``kvpress_baseline.py --tasks`` (kvpress) wrote for
the same samples and writes ``results/<name>_<mode>.json``: a row per method and budget, a
column per task (correct / samples) and the mean accuracy over tasks, with #18's targets.
Query-free selectors (keydiff, streaming) ignore the question, so their agnostic rows
stand in both tables, marked as such.

    hatch run bmrt-kv:python packages/bmrt-kv/benchmarks/suite_tables.py \\
        --bmrt suite_8k suite_8k_magicpig --kvpress kvpress_suite_8k --name side_by_side_8k

Several results files of either (a run split by task over processes) are read as one.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from fractions import Fraction

from common import QUERY_FREE, RESULTS, block_label, write_result
from ruler_suite import TASKS

from bmrt_kv import BMRTConfig

MODES = ("query_aware", "agnostic")


def _fraction(text: str) -> tuple[int, int]:
    hit, total = text.split("/")
    return int(hit), int(total)


def collect(bmrt: dict, kvpress: dict, mode: str, tokens: int):
    """{(method, B): {task: "k/n"}} for ``mode`` at ``tokens``, and the task order."""
    cells: dict = defaultdict(dict)
    tasks: list[str] = []
    for row in bmrt["rows"]:
        n, task, selector, budget, scoring, correct = row[:6]
        if n != tokens:
            continue
        tasks.append(task)
        base = scoring.split(" ")[0]
        if selector == "full":
            continue  # the full cache comes from kvpress's unchunked prefill, below
        if base == mode:
            cells[(f"bmrt-kv {selector}" + (f" {scoring}" if base != scoring else ""), budget)][
                task
            ] = correct
        elif selector in QUERY_FREE and base == "agnostic":
            cells[(f"bmrt-kv {selector} (query-free)", budget)][task] = correct
    for row in kvpress["rows"]:
        n, task, method, budget, scoring, correct = row[:6]
        if n == tokens and scoring == mode:
            tasks.append(task)
            cells[(method, budget)][task] = correct
    return cells, list(dict.fromkeys(tasks))


def mean(cell: dict, tasks: list[str]) -> Fraction | None:
    """Mean accuracy over ``tasks``, exact (two methods that tie compare equal, which float
    sums of different fractions may not); None unless every task ran."""
    if any(t not in cell for t in tasks):
        return None
    return sum((Fraction(*_fraction(cell[t])) for t in tasks), Fraction(0)) / len(tasks)


def table(cells: dict, tasks: list[str]) -> list[list]:
    """A row per (method, budget): the full cache first, then by budget and best mean."""
    scored = [(key, cell, mean(cell, tasks)) for key, cell in cells.items()]
    scored.sort(
        key=lambda x: (-1 if x[0][1] == "-" else x[0][1], -(-1 if x[2] is None else x[2]), x[0][0])
    )
    return [
        [method, budget]
        + [cell.get(t, "-") for t in tasks]
        + ["-" if m is None else f"{float(100 * m):.1f}"]
        for (method, budget), cell, m in scored
    ]


def defaults_label(budget: int, scoring: str) -> str:
    """The row label of ``BMRTConfig(budget=budget, scoring=scoring)``: a block other than
    512 tokens shows in labels ("bmrt-kv keydiff (block 256)"), as suite.py writes them."""
    config = BMRTConfig(budget=budget, scoring=scoring)
    return f"bmrt-kv {config.selector}{block_label(config)}"


def targets(cells: dict, tasks: list[str], mode: str) -> list[dict]:
    """#18's targets for ``mode``, judged on the rows that ran every task."""
    means = {k: mean(c, tasks) for k, c in cells.items()}
    means = {k: v for k, v in means.items() if v is not None}
    full = means.get(("full", "-"))
    default = BMRTConfig().selector
    out = []
    for budget in sorted({b for _, b in means if b != "-"}):
        kv = {m: v for (m, b), v in means.items() if b == budget and m.startswith("kvpress")}
        ours = {m: v for (m, b), v in means.items() if b == budget and m.startswith("bmrt-kv")}
        if not kv or not ours:
            continue
        best_kv = max(kv, key=kv.get)
        if mode == "query_aware":
            # Exactly the defaults' label at this budget: another block size, question
            # weight or option is another configuration.
            mine = defaults_label(budget, mode)
            label = f"the defaults ({default})"
            if mine not in ours:
                # Not judged on part of the tasks (or none), and not passed either.
                ran = [t for t in tasks if t in cells.get((mine, budget), {})]
                out.append(
                    {
                        "target": f"{mode}, B={budget}: {label} >= best kvpress press",
                        "measured": f"not judged: {mine} ran {len(ran)} of the {len(tasks)} "
                        f"tasks ({best_kv} {float(100 * kv[best_kv]):.1f}%)",
                        "met": False,
                    }
                )
                continue
        else:
            mine = max(ours, key=ours.get)
            label = "best agnostic bmrt-kv"
        out.append(
            {
                "target": f"{mode}, B={budget}: {label} >= best kvpress press",
                "measured": f"{mine} {float(100 * ours[mine]):.1f}% vs {best_kv} {float(100 * kv[best_kv]):.1f}%",
                "met": ours[mine] >= kv[best_kv],
            }
        )
        if mode == "query_aware" and budget == 1024 and full is not None:
            out.append(
                {
                    "target": "query_aware, B=1024: the defaults >= 90% of the full cache",
                    "measured": f"{float(100 * ours[mine]):.1f}% vs full {float(100 * full):.1f}%"
                    + (f" ({float(100 * ours[mine] / full):.0f}% of it)" if full else ""),
                    "met": full > 0 and ours[mine] >= Fraction(9, 10) * full,
                }
            )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bmrt",
        nargs="+",
        default=["suite_8k"],
        help="results/<name>.json of suite.py; several are read as one (their rows joined)",
    )
    parser.add_argument(
        "--kvpress",
        nargs="+",
        default=["kvpress_suite_8k"],
        help="results/<name>.json of kvpress_baseline.py; several are read as one",
    )
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="only these tasks (e.g. the ones a cut-off run reached): the title says so",
    )
    parser.add_argument("--name", default="side_by_side_8k")
    args = parser.parse_args(argv)
    runs = {name: json.loads((RESULTS / f"{name}.json").read_text()) for name in args.bmrt}
    bmrt = {"rows": [row for run in runs.values() for row in run["rows"]]}
    sources = " and ".join(
        f"results/{name}.json ({run['command']}; {run['notes']})" for name, run in runs.items()
    )
    kv_runs = {n: json.loads((RESULTS / f"{n}.json").read_text()) for n in args.kvpress}
    kvpress = {"rows": [row for run in kv_runs.values() for row in run["rows"]]}
    kv_sources = " and ".join(
        f"results/{n}.json ({run['command']}; {run['notes']})" for n, run in kv_runs.items()
    )
    for mode in args.modes:
        cells, tasks = collect(bmrt, kvpress, mode, args.tokens)
        subset = ""
        if args.tasks:
            missing = [t for t in args.tasks if t not in tasks]
            if missing:
                raise SystemExit(f"--tasks: no {mode} rows for {missing} at {args.tokens} tokens")
            tasks = [t for t in tasks if t in args.tasks]
        if len(tasks) < len(TASKS):
            # Counted against the suite, not against the rows found (3 of 7, not 3 of 3).
            subset = f", {len(tasks)} of the {len(TASKS)} tasks"
        write_result(
            f"{args.name}_{mode}",
            f"Side by side, {mode.replace('_', '-')}: bmrt-kv and kvpress on the RULER-style "
            f"suite at {args.tokens} tokens{subset} (correct / samples per task, mean over "
            "tasks %)",
            ["method", "B", *tasks, "mean %"],
            table(cells, tasks),
            targets(cells, tasks, mode),
            command="hatch run bmrt-kv:python packages/bmrt-kv/benchmarks/suite_tables.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            notes=f"From {sources} and {kv_sources}. The "
            "full cache row is kvpress's uncompressed prefill of the same samples. "
            f"bmrt-kv's defaults select with {BMRTConfig().selector}, in blocks of "
            "min(512, B) tokens agnostic and min(512, 2B) query-aware (bmrt-kv 0.9.0; a "
            "row labelled without '(block N)' used 512-token blocks).",
        )


if __name__ == "__main__":
    main()
