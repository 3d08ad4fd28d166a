"""Run every package's tests in its own hatch environment, then the integration tests.

This is README command 2 (`hatch run test:all`). Every step runs even when an earlier
one fails; the script exits non-zero if any step failed, collected no test (pytest's
exit 5), or errored. The last line is the total over all steps.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from _common import PACKAGES, ROOT, hatch


def _counts(junit: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) from a pytest JUnit XML file."""
    if not junit.is_file():
        return 0, 0, 0
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = failed = skipped = 0
    for s in suites:
        total += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return total - failed - skipped, failed, skipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="*", help="steps to run (package names, memcheck, integration)"
    )
    args = parser.parse_args()

    steps = [(name, [f"{name}:test"]) for name in PACKAGES]
    steps.append(("memcheck", ["paired-cache:memcheck"]))
    steps.append(("integration", ["default:integration"]))
    if args.only:
        steps = [s for s in steps if s[0] in args.only]

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, target in steps:
            junit = Path(tmp) / f"{name}.xml"
            extra = [] if name == "memcheck" else [f"--junitxml={junit}", "-q"]
            print(f"\n===== {name}: hatch run {' '.join(target)} =====", flush=True)
            start = time.perf_counter()
            rc = subprocess.call([hatch(), "run", *target, *extra], cwd=ROOT)
            seconds = time.perf_counter() - start
            passed, failed, skipped = _counts(junit)
            if name == "memcheck":
                passed, failed = (1, 0) if rc == 0 else (0, 1)
            results.append((name, rc, passed, failed, skipped, seconds))

    print("\n===== summary =====")
    bad = []
    for name, rc, passed, failed, skipped, seconds in results:
        status = "ok" if rc == 0 else ("NO TESTS" if rc == 5 else f"FAILED (exit {rc})")
        if rc != 0:
            bad.append(name)
        print(
            f"{name:18s} {passed:5d} passed {failed:4d} failed {skipped:4d} skipped "
            f"{seconds:7.1f} s  {status}"
        )
    passed = sum(r[2] for r in results)
    failed = sum(r[3] for r in results) + sum(1 for r in results if r[1] != 0 and r[3] == 0)
    skipped = sum(r[4] for r in results)
    if bad:
        print(f"failed steps: {', '.join(bad)}")
    print(f"test-all: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
