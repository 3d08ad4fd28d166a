"""Writing a benchmark's JSON and markdown table (shared by this package's benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PACKAGE = "zstd-linear"
COMMAND = "hatch run zstd-linear:bench"


def markdown(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, columns, rows, targets, notes: str) -> dict:
    from membound_testing import machine_info

    result = {
        "package": PACKAGE,
        "benchmark": name,
        "title": title,
        "command": COMMAND,
        "machine": machine_info(),
        "columns": columns,
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n### {title}\n\n{markdown(columns, rows)}\n")
    for t in targets:
        print(f"- target: {t['target']}: {t['measured']} ({'met' if t['met'] else 'NOT met'})")
    return result
