"""The one benchmark-result writer: every benchmark, the demo and the budget runner write
their tables through it, and ``tools/bench.py`` renders them into the READMEs with it.

A result is a JSON object::

    {"package", "benchmark", "title", "command", "machine", "columns", "rows",
     "targets": [{"target", "measured", "met"}], "notes"}

written to ``<results_dir>/<benchmark>.json`` under a temporary name and renamed, so a
reader never sees half a file and an interrupted run leaves the previous result in place.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _cell(value) -> str:
    # Benchmarks round their own numbers: render them as written (None: an empty cell).
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns, rows) -> str:
    """A markdown table of ``rows`` (lists, one value per column) under ``columns``."""
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def render_result(result: dict, heading: str = "###") -> str:
    """The markdown section of one result: title, date and machine, table, targets, notes."""
    m = result.get("machine", {})
    simd = f" ({m['simd']})" if m.get("simd") else ""
    stamp = (
        f"{m.get('date', '?')}, {m.get('cpu', '?')}{simd}, {m.get('cores', '?')} cores, "
        f"{m.get('mem_gib', '?')} GiB"
    )
    lines = [f"{heading} {result['package']}: {result.get('title', result['benchmark'])}", ""]
    lines += [f"Measured {stamp} with `{result.get('command', '?')}`.", ""]
    if result.get("columns"):
        lines += [markdown_table(result["columns"], result.get("rows", [])), ""]
    targets = result.get("targets", [])
    if targets:
        rows = [[t["target"], t["measured"], "yes" if t.get("met") else "**no**"] for t in targets]
        lines += [markdown_table(["target", "measured", "met"], rows), ""]
    if result.get("notes"):
        lines += [f"Notes: {result['notes']}", ""]
    return "\n".join(lines)


def write_json_atomic(path: str | os.PathLike, data) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary file in the same directory
    and a rename. The file gets the process's umask, not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, ensure_ascii=False)
            f.write("\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_result(
    results_dir: str | os.PathLike,
    *,
    package: str,
    name: str,
    title: str,
    command: str,
    columns,
    rows,
    targets=(),
    notes: str = "",
    save: bool = True,
) -> dict:
    """Write ``<results_dir>/<name>.json`` atomically (unless ``save`` is False, as for a
    smoke run), print its markdown section, and return the result.

    ``targets``: dicts with ``target`` (what was asked), ``measured`` (what was seen) and
    ``met`` (bool). Rows are lists with one value per column, rounded by the caller.
    """
    from membound_testing.machine import machine_info

    result = {
        "package": package,
        "benchmark": name,
        "title": title,
        "command": command,
        "machine": machine_info(),
        "columns": list(columns),
        "rows": [list(r) for r in rows],
        "targets": [dict(t) for t in targets],
        "notes": notes,
    }
    if save:
        write_json_atomic(Path(results_dir) / f"{name}.json", result)
    print("\n" + render_result(result), flush=True)
    return result
