"""Writing benchmark results: JSON beside the package, markdown to stdout."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
COMMAND = "hatch run paired-cache:bench"
NOISE = (
    "Measured on a 2-core machine: absolute times move with whatever else runs there, so "
    "read the side-by-side ratios within one run."
)


def write_result(
    name: str, title: str, columns, rows, targets, notes: str, save: bool = True
) -> dict:
    """results/<name>.json through membound's one results writer (atomic; not written if
    save is False: --quick smoke runs), and its markdown table."""
    from membound_testing.results import write_result as write

    return write(
        RESULTS,
        package="paired-cache",
        name=name,
        title=title,
        command=COMMAND,
        columns=columns,
        rows=rows,
        targets=targets,
        notes=notes,
        save=save,
    )
