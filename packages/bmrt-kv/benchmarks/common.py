"""Shared by the benchmarks: the JSON result format and its markdown table."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
COMMAND = "hatch run bmrt-kv:bench"


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
