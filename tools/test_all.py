"""Run the integration tests, the C core under valgrind, bmrt-kv's tests on its oldest
transformers, and every package's tests against its built wheel in a fresh venv.

This is README command 2 (`hatch run test:all`). Every step runs even when an earlier
one fails; the script exits non-zero if any step failed, collected no test (pytest's
exit 5), or errored. The `release:<package>` steps run `tools/release.py <package> --tests`
(the wheel as users get it, with the extras its hatch environment installs, read from
hatch.toml); their counts are listed apart from the other steps' and added to the total on
the last line.

Each package's tests run once, against its wheel, not a second time against the editable
tree as well: the two runs tested the same code with the same pins (the wheel check takes
the pins of the package's hatch environment, transformers 5.24 for bmrt-kv), and together
took the suite to 52 minutes on the 2-core CI machine. bmrt-kv also runs on the oldest
transformers its metadata allows (bmrt-kv-floor, 5.2): transformers' Cache API, which it
plugs into, moves between releases. `--editable` adds the editable-tree steps
(`hatch run <package>:test`); so does naming them in `--only`.

Two steps run side by side (`--jobs`, default 2, the CI machine's cores): the budget
runner's tests (`tests-integration/tests/test_budget.py`) first, beside nothing but the C
core's memcheck (they refuse to measure while another process maps the model cache, they
drop the page cache and time throttled reads), then the rest longest first, never two in one
hatch environment. The other integration tests are a step of their own (`integration`):
while they were one step with the budget runner's, the second core idled for five minutes. Each side-by-side step gets
OMP_NUM_THREADS = cores / jobs (unless it is set): two steps each running torch on both
cores took paired-cache's wheel tests from 378 s alone to 762 s, against 562 s with one
thread each. A step's output goes to a file while it runs and is printed whole when it
ends; `--jobs 1` runs one step at a time and streams its output, as before.

Before an environment's first step its workspace members are reinstalled from the tree
(`tools/sync_envs.py`): hatch does not notice a member's version bump or a changed C core
in an environment that already exists, and a stale install would be what gets tested.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from _common import PACKAGES, ROOT, hatch
from sync_envs import refresh

# Steps that run with nothing beside them: the budget runner's tests, which refuse to measure
# while another process maps a file under the model cache (the limit would not bind on pages
# that process keeps mapped), drop the page cache and time throttled reads.
ALONE = {"budget-runner"}
BUDGET_TESTS = "tests-integration/tests/test_budget.py"
# Steps that may run beside those: they map no model and measure no memory or time.
QUIET = {"memcheck"}
# Free space the suite needs under the temporary directory: a CI run on 2026-12-06 failed
# midway with "No space left on device" once the disk held about 1 GiB free (the wheel checks'
# venvs are 1.0-1.3 GiB each, pytest keeps its last three runs' temporary directories).
MIN_FREE_GIB = 20
# Seconds each step took in the last solo CI run (2-core machine): the scheduling order only.
SECONDS = {
    "release:diffulex-edge": 995,
    "release:moe-expert-cache": 867,
    "release:zstd-linear": 455,
    "integration": 300,
    "budget-runner": 95,
    "release:paired-cache": 378,
    "release:bmrt-kv": 323,
    "bmrt-kv-floor": 311,
    "memcheck": 93,
}


def _counts(junit: Path | None) -> tuple[int, int, int]:
    """(passed, failed, skipped) from a pytest JUnit XML file."""
    if junit is None or not junit.is_file():
        return 0, 0, 0
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError as error:  # a step killed while writing it (a full disk, a signal)
        print(f"unreadable JUnit file {junit}: {error}; the step counts as failed", flush=True)
        return 0, 0, 0
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = failed = skipped = 0
    for s in suites:
        total += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return total - failed - skipped, failed, skipped


def _total(results: list[tuple]) -> str:
    """'N passed, N failed, N skipped' over steps; a failed step with no failed test (a
    crash, a failed build) counts as one failure."""
    passed = sum(r[2] for r in results)
    failed = sum(r[3] for r in results) + sum(1 for r in results if r[1] != 0 and r[3] == 0)
    skipped = sum(r[4] for r in results)
    return f"{passed} passed, {failed} failed, {skipped} skipped"


def _start(name: str, command: list[str], env: str | None, tmp: Path, jobs: int) -> tuple:
    """Start one step. When steps run side by side its output goes to a file (printed whole
    when it ends), else straight through, and torch's intra-op pool gets the step's share
    of the cores (OMP_NUM_THREADS, unless set)."""
    if name == "memcheck":
        extra, junit = [], None
    elif name.startswith("release:"):
        # release.py writes <package>.xml into the directory it is given.
        extra = [f"--junit-dir={tmp}/release"]
        junit = tmp / "release" / f"{name.removeprefix('release:')}.xml"
    else:
        junit = tmp / f"{name}.xml"
        extra = [f"--junitxml={junit}", "-q"]
    shown = " ".join(["hatch run", *command[2:]] if command[0] == hatch() else command)
    print(f"\n===== {name}: {shown} =====", flush=True)
    path = tmp / f"{name.replace(':', '-')}.log" if jobs > 1 else None
    environ = dict(os.environ)
    # pytest keeps its last three sessions' temporary directories, model copies included
    # (11 GiB of them had piled up under /tmp when a CI run filled the disk): keep only
    # those of failed tests.
    environ.setdefault("PYTEST_ADDOPTS", "-o tmp_path_retention_policy=failed")
    if jobs > 1:
        environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    out = open(path, "wb") if path is not None else None  # noqa: SIM115 (closed by the child's end)
    try:
        process = subprocess.Popen(
            [*command, *extra],
            cwd=ROOT,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
    finally:
        if out is not None:
            out.close()  # the child holds its own descriptor
    return process, env, junit, path, time.perf_counter()


def _free_space_error(minimum_gib: float) -> str | None:
    """Why the suite cannot run here, if the temporary directory's disk has less than
    `minimum_gib` free (see MIN_FREE_GIB)."""
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    if free >= minimum_gib:
        return None
    return (
        f"only {free:.1f} GiB free under {tempfile.gettempdir()}; the suite needs at least "
        f"{minimum_gib:g} GiB (leftover release-* venvs and pytest-of-* directories there are "
        "safe to delete once no test runs)"
    )


def _may_start(name: str, env: str | None, running: dict[str, tuple], jobs: int) -> bool:
    """Whether a step may start beside the running ones (see ALONE and QUIET)."""
    if len(running) >= jobs or (env is not None and env in {r[1] for r in running.values()}):
        return False  # one step per hatch environment at a time
    if name in ALONE:
        return all(r in QUIET for r in running)
    return name in QUIET or not any(r in ALONE for r in running)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="*",
        help="steps to run (package names, bmrt-kv-floor, memcheck, budget-runner, integration, "
        "release:<package>, release)",
    )
    parser.add_argument(
        "--editable",
        action="store_true",
        help="also run every package's tests in its own hatch environment (editable tree)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="steps run side by side (default: 2, or 1 on a one-core machine)",
    )
    args = parser.parse_args()

    hatch_run = [hatch(), "run"]
    steps = [(name, [*hatch_run, f"{name}:test"]) for name in PACKAGES]
    # The hatch environment each non-release step runs in (refreshed before its first use).
    env_of = {name: name for name in PACKAGES}
    env_of.update({"bmrt-kv-floor": "bmrt-kv-floor", "memcheck": "paired-cache"})
    env_of["integration"] = env_of["budget-runner"] = "default"
    # bmrt-kv again on the oldest transformers its metadata allows (the Cache API moves).
    steps.append(("bmrt-kv-floor", [*hatch_run, "bmrt-kv-floor:test"]))
    steps.append(("memcheck", [*hatch_run, "paired-cache:memcheck"]))
    steps.append(("budget-runner", [*hatch_run, "default:pytest", BUDGET_TESTS]))
    steps.append(("integration", [*hatch_run, "default:integration", f"--ignore={BUDGET_TESTS}"]))
    release = [sys.executable, str(ROOT / "tools" / "release.py")]
    steps.extend(
        (f"release:{name}", [*release, name, "--tests", "--no-tag-check"]) for name in PACKAGES
    )
    if args.only:
        wanted = set(args.only)
        if "release" in wanted:
            wanted.update(f"release:{name}" for name in PACKAGES)
        steps = [s for s in steps if s[0] in wanted]
    elif not args.editable:
        # Editable-tree steps only on request: every package's tests run against its wheel
        # (release:<package>) with the same pins (see the module docstring).
        steps = [s for s in steps if s[0] not in PACKAGES]

    jobs = max(1, args.jobs)
    error = _free_space_error(MIN_FREE_GIB)
    if error is not None:
        print(f"test-all: not run: {error}", file=sys.stderr)
        return 1
    # Longest first (list scheduling): the order only, from the last solo CI run's seconds.
    steps.sort(key=lambda s: (s[0] not in ALONE, -SECONDS.get(s[0], 0)))
    results = []
    refreshed: dict[str, int] = {}
    running: dict[str, tuple] = {}  # name -> (process, env, junit, log, start)
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(steps)
        while pending or running:
            for step in list(pending):
                name, command = step
                env = env_of.get(name)
                if not _may_start(name, env, running, jobs):
                    if name in ALONE:
                        break  # it waits for the running steps; nothing starts past it
                    continue
                pending.remove(step)
                if env is not None and env not in refreshed:
                    refreshed[env] = refresh(env)
                if env is not None and refreshed[env] != 0:
                    print(f"\n===== {name}: not run, reinstalling {env}'s members failed =====")
                    results.append((name, refreshed[env], 0, 0, 0, 0.0))
                    continue
                running[name] = _start(name, command, env, Path(tmp), jobs)
            if running:
                time.sleep(0.5)
            for name, (process, _env, junit, log, start) in list(running.items()):
                rc = process.poll()
                if rc is None:
                    continue
                seconds = time.perf_counter() - start
                del running[name]
                if log is not None:
                    print(f"\n===== {name}: output =====", flush=True)
                    with open(log, "rb") as f:
                        sys.stdout.buffer.write(f.read())
                    sys.stdout.flush()
                print(f"===== {name}: exit {rc} after {seconds:.0f} s =====", flush=True)
                passed, failed, skipped = _counts(junit)
                if name == "memcheck":
                    passed, failed = (1, 0) if rc == 0 else (0, 1)
                results.append((name, rc, passed, failed, skipped, seconds))
    order = [s[0] for s in steps]
    results.sort(key=lambda r: order.index(r[0]))

    print("\n===== summary =====")
    bad = []
    for name, rc, passed, failed, skipped, seconds in results:
        status = "ok" if rc == 0 else ("NO TESTS" if rc == 5 else f"FAILED (exit {rc})")
        if rc != 0:
            bad.append(name)
        print(
            f"{name:24s} {passed:5d} passed {failed:4d} failed {skipped:4d} skipped "
            f"{seconds:7.1f} s  {status}"
        )
    if bad:
        print(f"failed steps: {', '.join(bad)}")
    wheels = [r for r in results if r[0].startswith("release:")]
    editable = [r for r in results if not r[0].startswith("release:")]
    for label, group in (("hatch environments", editable), ("built wheels", wheels)):
        if group:
            print(f"{label}: {_total(group)}")
    print(f"test-all: {_total(results)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
