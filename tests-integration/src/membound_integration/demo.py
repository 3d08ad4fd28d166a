"""membound's main job: the embedded model, plain and under each package, in one table.

Run as ``hatch run demo``. Every row runs in a fresh Python process, so the peak RSS
printed for a row is that row's own (``ru_maxrss`` only ever grows within a process).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time

from membound_integration.rows import ORDER

_MARK = "MEMBOUND-ROW "


def _row_functions() -> list[tuple[str, str]]:
    """(module, row id) for every row of every rows module that exists, in ORDER."""
    found = []
    for module in ORDER:
        try:
            mod = importlib.import_module(f"membound_integration.rows.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"membound_integration.rows.{module}":
                continue  # that package's rows have not landed yet
            raise
        found.extend((module, row_id) for row_id in mod.ROWS)
    return found


def _run_one(module: str, row_id: str) -> None:
    mod = importlib.import_module(f"membound_integration.rows.{module}")
    row = mod.ROWS[row_id]()
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    row.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    print(_MARK + json.dumps(row.to_dict()), flush=True)


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:,.1f} MiB"


def _render(rows: list[dict]) -> str:
    head = "| row | peak RSS | bounded component: resident / unbounded | tokens/s | output |"
    lines = [head, "|---|---:|---|---:|---|"]
    for r in rows:
        bounded = ""
        if r.get("resident_bytes") is not None:
            bounded = (
                f"{r['component']}: {_mib(r['resident_bytes'])} / {_mib(r['unbounded_bytes'])}"
            )
        out = r["output"].replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r['name']} | {_mib(r['peak_rss_bytes'])} | {bounded} "
            f"| {r['tokens_per_s']:.1f} | {out} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", help="run one row in this process (used by the demo itself)")
    parser.add_argument("--only", nargs="*", help="row ids to run (default: all)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)

    if args.row:
        module, row_id = args.row.split(":", 1)
        _run_one(module, row_id)
        return 0

    from tqdm import tqdm

    todo = [(m, r) for m, r in _row_functions() if not args.only or r in args.only]
    rows, failed = [], []
    start = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with tqdm(todo, desc="demo rows", unit="row") as bar:
        for module, row_id in bar:
            bar.set_postfix_str(row_id)
            proc = subprocess.run(
                [sys.executable, "-m", "membound_integration.demo", "--row", f"{module}:{row_id}"],
                capture_output=True,
                text=True,
                env=env,
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
            if proc.returncode != 0 or not lines:
                failed.append(row_id)
                tqdm.write(f"row {row_id} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                continue
            rows.append(json.loads(lines[-1][len(_MARK) :]))
    print()
    print(_render(rows))
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if failed:
        print(f"failed rows: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
