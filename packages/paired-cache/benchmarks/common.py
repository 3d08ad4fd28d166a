"""Writing benchmark results: JSON beside the package, markdown to stdout."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from membound_testing import machine_info
from paired_cache.microbench import markdown

RESULTS = Path(__file__).resolve().parent / "results"
COMMAND = "hatch run paired-cache:bench"
NOISE = (
    "Measured on a 2-core machine: absolute times move with whatever else runs there, so "
    "read the side-by-side ratios within one run."
)


def write_result(
    name: str, title: str, columns, rows, targets, notes: str, save: bool = True
) -> dict:
    """Write results/<name>.json atomically (unless save is False: --quick smoke runs)
    and print its markdown table."""
    payload = {
        "package": "paired-cache",
        "benchmark": name,
        "title": title,
        "command": COMMAND,
        "machine": machine_info(),
        "columns": columns,
        "rows": rows,
        "targets": targets,
        "notes": notes,
    }
    if save:
        RESULTS.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=RESULTS, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, ensure_ascii=False)
        os.replace(tmp, RESULTS / f"{name}.json")
    print(f"\n### {title}\n\n{markdown(columns, rows)}\n")
    for t in targets:
        print(f"- target: {t['target']} -> {t['measured']} ({'met' if t['met'] else 'NOT met'})")
    return payload
