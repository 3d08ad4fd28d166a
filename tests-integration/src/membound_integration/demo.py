"""membound's main job: the embedded model, plain and under each package, in one table.

Run as ``hatch run demo``. Every row runs in a fresh Python process, so the peak RSS
printed for a row is that row's own (``ru_maxrss`` only ever grows within a process).
A row's own progress bars (long prefills, the one-time .zlin build) are relayed into the
demo's bar; the rest of a row's stderr is shown only if the row fails.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time

from membound_integration.rows import ORDER

_MARK = "MEMBOUND-ROW "
# A progress line of a row: tqdm ("blocks:  50%|#####     | 6/12 [...]") or zstd-linear's
# own bar ("compress [#####.....] 12/210 name 4.1s").
_BAR = re.compile(
    r"^(?P<desc>\w[\w .-]*?):?\s*(?:\d+%\|[^|]*\||\[[#.]+\])\s*(?P<n>\d+)/(?P<total>\d+)"
)


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


def row_command(module: str, row_id: str) -> list[str]:
    """The command that runs one row in a fresh process and prints it as a marked line."""
    return [sys.executable, "-m", "membound_integration.demo", "--row", f"{module}:{row_id}"]


def parse_row(stdout: str) -> dict | None:
    """The row a row process printed (None if it printed none)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(_MARK)]
    return json.loads(lines[-1][len(_MARK) :]) if lines else None


def run_prepare(modules: list[str]) -> None:
    """The one-time conversions of these rows modules (prepare.py), in their own process,
    before any row runs."""
    command = [sys.executable, "-m", "membound_integration.prepare", "--only", *modules]
    subprocess.run(command, check=True)


def _run_one(module: str, row_id: str) -> None:
    mod = importlib.import_module(f"membound_integration.rows.{module}")
    row = mod.ROWS[row_id]()
    # ru_maxrss is in KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    row.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    print(_MARK + json.dumps(row.to_dict()), flush=True)


def _mib(n: int | None) -> str:
    if n is None:
        return ""
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _run_row(module: str, row_id: str, env: dict, bar) -> tuple[int, str, str]:
    """Run one row in a fresh process; returns (exit code, stdout, stderr tail).

    The row's progress lines become the bar's postfix as they arrive.
    """
    proc = subprocess.Popen(
        row_command(module, row_id),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))
    reader.start()
    tail: collections.deque[str] = collections.deque(maxlen=60)
    pending = b""
    for chunk in iter(lambda: proc.stderr.read1(4096), b""):
        *lines, pending = re.split(rb"[\r\n]", pending + chunk)
        for raw in lines:
            line = raw.decode(errors="replace").strip()
            match = _BAR.match(line)
            if match:
                bar.set_postfix_str(f"{row_id}: {match['desc']} {match['n']}/{match['total']}")
            elif line:
                tail.append(line)
    proc.wait()
    reader.join()
    return proc.returncode, b"".join(out).decode(errors="replace"), "\n".join(tail)


def _render(rows: list[dict]) -> str:
    head = (
        "| row | peak RSS | bounded component: resident / unbounded | tokens/s | s | output "
        "| right answer |"
    )
    lines = [head, "|---|---:|---|---:|---:|---|---|"]
    for r in rows:
        bounded = ""
        if r.get("resident_bytes") is not None:
            bounded = (
                f"{r['component']}: {_mib(r['resident_bytes'])} / {_mib(r['unbounded_bytes'])}"
            )
        out = r["output"].replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r['name']} | {_mib(r['peak_rss_bytes'])} | {bounded} "
            f"| {r['tokens_per_s']:.1f} | {r.get('seconds', 0):.0f} | {out} "
            f"| {'yes' if r['correct'] else '**no**'} |"
        )
    return "\n".join(lines)


def _write_results(path: str, rows, failed, total: float, load, subset: bool) -> None:
    """The demo's table as a benchmark result (tools/bench.py renders it)."""
    from pathlib import Path

    from membound_testing.results import write_result

    def mib(n):
        return None if n is None else round(n / 2**20, 2)

    table = [
        [
            r["name"],
            mib(r["peak_rss_bytes"]),
            r.get("component") or "",
            mib(r.get("resident_bytes")),
            mib(r.get("unbounded_bytes")),
            round(r["tokens_per_s"], 1),
            r.get("seconds"),
            r["output"].replace("\n", " "),
            "yes" if r["correct"] else "no",
        ]
        for r in rows
    ]
    measured = f"{total:.0f} s for {len(rows)} rows"
    if failed:
        measured += f" ({len(failed)} failed: {', '.join(failed)})"
    wrong = [r["name"] for r in rows if not r["correct"]]
    write_result(
        Path(path).parent,
        package="membound",
        name=Path(path).stem,
        title="The demo: SmolLM2-135M plain and under each package, one process per row "
        "(no memory limit; peak RSS counts evictable file pages)",
        command="hatch run demo",
        columns=[
            "row",
            "peak RSS MiB",
            "bounded component",
            "resident MiB",
            "unbounded MiB",
            "tokens/s",
            "s",
            "output",
            "right answer",
        ],
        rows=table,
        targets=[
            {
                "target": "the whole demo <= 5 minutes here, every row right",
                "measured": measured
                + (" (a subset: --only)" if subset else "")
                + (f"; wrong: {', '.join(wrong)}" if wrong else ""),
                "met": total <= 300 and not failed and not subset and not wrong,
            }
        ],
        notes=f"1-minute load average {load:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end (2 cores). Model preparation (the float copy, "
        ".zlin files, the MoEfied SmolLM2, the .pte) ran before the rows and is not in their "
        "figures.",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", help="run one row in this process (used by the demo itself)")
    parser.add_argument("--only", nargs="*", help="row ids to run (default: all)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument(
        "--results",
        help="also write the table in the benchmarks' result format (tools/bench.py renders "
        "it into the README's Measured section) to this file",
    )
    args = parser.parse_args(argv)

    if args.row:
        module, row_id = args.row.split(":", 1)
        _run_one(module, row_id)
        return 0

    from tqdm import tqdm

    todo = [(m, r) for m, r in _row_functions() if not args.only or r in args.only]
    run_prepare(sorted({m for m, _ in todo}))
    rows, failed = [], []
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with tqdm(todo, desc="demo rows", unit="row") as bar:
        for module, row_id in bar:
            bar.set_postfix_str(row_id)
            row_start = time.perf_counter()
            code, stdout, stderr = _run_row(module, row_id, env, bar)
            row = parse_row(stdout)
            if code != 0 or row is None:
                failed.append(row_id)
                tqdm.write(f"row {row_id} failed (exit {code}):\n{stderr[-3000:]}")
                continue
            row["seconds"] = round(time.perf_counter() - row_start, 1)
            rows.append(row)
    print()
    print(_render(rows))
    total = time.perf_counter() - start
    print(f"\n{len(rows)} rows in {total:.0f} s")
    if args.results:
        _write_results(args.results, rows, failed, total, load_start, subset=bool(args.only))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    wrong = [r["name"] for r in rows if not r["correct"]]
    if failed or wrong:
        print(
            f"failed rows: {', '.join(failed)}; wrong answers: {', '.join(wrong)}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
