"""Shared by the benchmarks: the JSON result format and its markdown table."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
COMMAND = "hatch run bmrt-kv:bench"


def write_result(name: str, title: str, columns, rows, targets, notes: str, command=COMMAND):
    """Write results/<name>.json (temp file + rename) and print the markdown table."""
    from membound_testing import machine_info

    data = {
        "package": "bmrt-kv",
        "benchmark": name,
        "title": title,
        "command": command,
        "machine": machine_info(),
        "columns": list(columns),
        "rows": [list(r) for r in rows],
        "targets": targets,
        "notes": notes,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    fd, tmp = tempfile.mkstemp(dir=RESULTS, prefix=f".{name}", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=1)
    os.replace(tmp, path)
    print(f"\n### {title}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")
    for target in targets:
        print(
            f"- {target['target']}: {target['measured']} ({'met' if target['met'] else 'NOT met'})"
        )
    return path
