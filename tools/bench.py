"""Run every package's benchmarks in its own environment and render the measured tables.

`hatch run bench` runs `hatch run <package>:bench` for each package (each benchmark writes
JSON to packages/<package>/benchmarks/results/), then renders that JSON: every table of a
package into packages/<package>/benchmarks/RESULTS.md (the package README's "Measured"
section links to it), the budget runner's table into the root README's and the demo's
into tests-integration/RESULTS.md. `--render-only` skips the runs. Only JSON written by a
real run is rendered; every table carries its date, machine and command.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import _common
from _common import PACKAGES, ROOT, hatch
from sync_envs import refresh

from membound_testing.results import render_result

START, END = "<!-- measured:start -->", "<!-- measured:end -->"


def load_results(package: str) -> list[dict]:
    folder = ROOT / "packages" / package / "benchmarks" / "results"
    out = []
    for path in sorted(folder.glob("*.json")):
        with open(path) as f:
            out.append(json.load(f))
    return out


def replace_section(path: Path, body: str) -> bool:
    """Replace what lies between the measured markers of ``path``; False if it has none."""
    return _common.replace_section(path, body, START, END)


RESULTS_LINK = (
    "Every measured table, with its date, machine and the command that wrote it: "
    "[benchmarks/RESULTS.md](benchmarks/RESULTS.md)."
)


DEMO_PAGE = ROOT / "tests-integration" / "RESULTS.md"


def write_page(path: Path, title: str, results: list[dict]) -> Path:
    """A page of every table of ``results`` (their JSON in results/ beside the page),
    written atomically."""
    head = (
        f"# {title}\n\nRendered by `tools/bench.py` from the JSON in "
        "[results/](results/), each table as its benchmark wrote it; newer rows and "
        "findings are summarised in the [README](../README.md).\n\n"
    )
    body = "\n".join(render_result(r, heading="##") for r in results)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(head + body.rstrip() + "\n")
    tmp.replace(path)
    return path


def write_results_page(package: str, results: list[dict]) -> Path:
    """packages/<package>/benchmarks/RESULTS.md: every table of the package's results."""
    path = ROOT / "packages" / package / "benchmarks" / "RESULTS.md"
    return write_page(path, f"{package}: measured", results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render-only", action="store_true", help="render existing JSON only")
    parser.add_argument("--only", nargs="*", choices=list(PACKAGES), help="packages to run")
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    args = parser.parse_args()

    packages = args.only or list(PACKAGES)
    failed = []
    if not args.render_only:
        for package in packages:
            print(f"\n===== {package}: hatch run {package}:bench =====", flush=True)
            cmd = [hatch(), "run", f"{package}:bench"] + (["--quick"] if args.quick else [])
            # A stale editable install would be what gets measured (tools/sync_envs.py).
            if refresh(package) != 0 or subprocess.call(cmd, cwd=ROOT) != 0:
                failed.append(package)

    sections = []
    # The headline: every row under hard memory limits (`hatch run budget` writes it;
    # it takes about an hour, so `hatch run bench` renders it but does not run it).
    budget = ROOT / "tests-integration" / "results" / "budget.json"
    if budget.is_file():
        with open(budget) as f:
            sections.append(render_result(json.load(f)))
    demo = ROOT / "tests-integration" / "results" / "demo.json"
    if not args.render_only and not args.only:
        print("\n===== demo: hatch run demo =====", flush=True)
        demo.parent.mkdir(exist_ok=True)
        demo_cmd = [hatch(), "run", "default:demo", "--results", str(demo)]
        if refresh("default") != 0 or subprocess.call(demo_cmd, cwd=ROOT):
            failed.append("demo")
    links = []
    if demo.is_file():  # the demo's table on its own page: the README keeps one table
        with open(demo) as f:
            write_page(DEMO_PAGE, "membound: the demo", [json.load(f)])
        links.append(
            "- the demo, every row without a limit: [RESULTS.md](tests-integration/RESULTS.md)"
        )
    for package in PACKAGES:
        results = load_results(package)
        if not results:
            continue
        write_results_page(package, results)
        replace_section(ROOT / "packages" / package / "README.md", RESULTS_LINK)
        links.append(f"- {package}: [RESULTS.md](packages/{package}/benchmarks/RESULTS.md)")
    if links:
        sections.append("Every other table:\n\n" + "\n".join(links))
    if sections:
        replace_section(ROOT / "README.md", "\n".join(sections))
        print("\n".join(sections))
    if failed:
        print(f"benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
