"""Writing a benchmark's JSON and markdown table (shared by this package's benchmarks)."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PACKAGE = "zstd-linear"
COMMAND = "hatch run zstd-linear:bench"


def markdown(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, columns, rows, targets, notes: str) -> dict:
    """results/<name>.json through membound's one results writer (atomic), and its table."""
    from membound_testing.results import write_result as write

    return write(
        RESULTS,
        package=PACKAGE,
        name=name,
        title=title,
        command=COMMAND,
        columns=columns,
        rows=rows,
        targets=targets,
        notes=notes,
    )
