"""Shared by the benchmarks: the JSON result format and its markdown table."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
COMMAND = "hatch run bmrt-kv:bench"


def add_run_flags(parser) -> None:
    """The flags passkey.py and suite.py share: threads, selector options, --append."""
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--kernel", type=int, default=None, help="max-pool width for exact and snapkv (odd)"
    )
    parser.add_argument(
        "--question-weight",
        type=float,
        default=0.5,
        help="query-aware rows: the question's share of the scoring weight, in (0, 1]",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the rows to results/<name>.json instead of replacing it",
    )


def write_result(name: str, title: str, columns, rows, targets, notes: str, command=COMMAND):
    """results/<name>.json through membound's one results writer (atomic), and its table;
    returns the path."""
    from membound_testing.results import write_result as write

    write(
        RESULTS,
        package="bmrt-kv",
        name=name,
        title=title,
        command=command,
        columns=columns,
        rows=rows,
        targets=targets,
        notes=notes,
    )
    return RESULTS / f"{name}.json"
