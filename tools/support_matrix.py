"""Run each package's support-matrix tests and render the READMEs' support tables from them.

`python tools/support_matrix.py` runs `packages/<package>/tests/test_support_matrix.py` in the
package's hatch environment with MEMBOUND_SUPPORT_OUT set (membound_testing.support), keeps
the records as `packages/<package>/benchmarks/support_matrix.json`, and rewrites the section
between the support markers of the package README (the table) and of the root README (one
line a package). A package whose tests fail keeps its previous JSON and tables.
`--render-only` renders the JSON already there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _common
from _common import PACKAGES, ROOT, hatch
from sync_envs import refresh

from membound_testing.results import write_json_atomic
from membound_testing.support import OUT_ENV, load_records, markdown, matrix, summary

START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def matrix_json(package: str) -> Path:
    return ROOT / "packages" / package / "benchmarks" / "support_matrix.json"


def replace_section(path: Path, body: str) -> bool:
    """Replace what lies between the support markers of ``path``; False if it has none."""
    return _common.replace_section(path, body, START, END)


def run(package: str) -> bool:
    """Run the package's support tests; on success keep their records as its JSON."""
    tests = ROOT / "packages" / package / "tests" / "test_support_matrix.py"
    if not tests.is_file():
        print(f"{package}: no {tests.relative_to(ROOT)}", file=sys.stderr)
        return False
    if refresh(package) != 0:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.jsonl"
        env = {**os.environ, OUT_ENV: str(out)}
        cmd = [hatch(), "run", f"{package}:python", "-m", "pytest", "-q", str(tests)]
        if subprocess.call(cmd, cwd=ROOT, env=env) != 0:
            print(f"{package}: support tests failed; its tables are left as they were")
            return False
        m = matrix(load_records(out))
    write_json_atomic(matrix_json(package), m)
    return True


def render() -> None:
    lines = []
    for package in sorted(PACKAGES):
        path = matrix_json(package)
        if not path.is_file():
            continue
        m = json.loads(path.read_text(encoding="utf-8"))
        replace_section(ROOT / "packages" / package / "README.md", markdown(m))
        lines.append(f"- `{package}`: {summary(m)}")
    replace_section(ROOT / "README.md", "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render-only", action="store_true", help="render the JSON there")
    parser.add_argument("--only", nargs="*", choices=list(PACKAGES), help="packages to run")
    args = parser.parse_args()
    failed = []
    if not args.render_only:
        failed = [p for p in args.only or PACKAGES if not run(p)]
    render()
    if failed:
        print(f"support tests failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
