"""The budget runner: a command, or every demo row, under a hard memory limit.

    python -m membound_integration.budget run --limit 480M [--read-mbps 200] -- CMD ...
    python -m membound_integration.budget bisect [--expect TEXT] -- CMD ...
    python -m membound_integration.budget rows [--rows ID ...] [--profiles NAME ...]

`hatch run budget` is `rows` with every row and profile: see suite.py. Where no cgroup
can be made (not root, no memory controller) it says so in one line and exits 2: it
never measures something else instead.
"""

from __future__ import annotations

import argparse
import re
import sys

from membound_testing.budget.cgroup import CgroupUnavailable, block_device_of
from membound_testing.budget.profiles import MB, PROFILES, MiB
from membound_testing.budget.runner import (
    MappedElsewhere,
    RunResult,
    bisect_min_limit,
    run_limited,
)


def parse_size(text: str) -> int:
    """'480M', '2G', '512MiB', '1048576' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 480M, 2G)")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m[2].upper()]
    return int(float(m[1]) * scale)


def _report(result: RunResult, expect: str | None) -> bool:
    ok = result.completed and (expect is None or expect in result.stdout)
    verdict = (
        "ok" if ok else ("fail: " + result.status if not result.completed else "fail: wrong output")
    )
    print(
        f"{verdict}; wall {result.wall_s:.1f} s; peak anon {result.peak_anon / MiB:.1f} MiB, "
        f"file mapped {result.peak_file_mapped / MiB:.1f} MiB, page cache "
        f"{result.peak_cache / MiB:.1f} MiB (process: RssAnon {result.peak_rss_anon / MiB:.1f}, "
        f"RssFile {result.peak_rss_file / MiB:.1f} MiB); read {result.read_bytes / MiB:.1f} MiB"
        + (f"; {result.cache_note}" if result.cache_note else "")
    )
    return ok


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="budget",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")

    def limits(p, default_limit=None):
        p.add_argument("--read-mbps", type=float, help="throttle reads to this many MB/s")
        p.add_argument("--device-path", default=".", help="a path on the disk to throttle")
        p.add_argument("--timeout", type=float, help="kill a run after this many seconds")
        p.add_argument("--expect", help="the run passes only if its stdout contains this")
        p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")

    run = sub.add_parser("run", help="run a command once under a limit")
    run.add_argument("--limit", type=parse_size, required=True, help="hard memory limit")
    limits(run)
    bis = sub.add_parser("bisect", help="the smallest limit at which a command passes")
    bis.add_argument("--lo", type=parse_size, default=64 * MiB, help="a limit taken to fail")
    bis.add_argument("--hi", type=parse_size, default=2 * 2**30, help="a limit that passes")
    bis.add_argument("--resolution", type=parse_size, default=16 * MiB)
    limits(bis)
    rows = sub.add_parser("rows", help="every demo row under every profile (hatch run budget)")
    rows.add_argument("--rows", nargs="*", help="row ids (default: all)")
    rows.add_argument("--profiles", nargs="*", choices=list(PROFILES), default=list(PROFILES))
    rows.add_argument("--no-bisect", action="store_true", help="skip the minimum-limit search")
    rows.add_argument("--render-only", action="store_true", help="render budget-raw.json only")
    rows.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    cur = sub.add_parser("curve", help="tokens/s against the hard limit (results/budget-curve.svg)")
    cur.add_argument("--rows", nargs="*", default=None, help="row ids (default: the weight rows)")
    cur.add_argument("--limits", nargs="*", type=int, default=None, help="hard limits, MiB")
    cur.add_argument("--render-only", action="store_true", help="draw budget-curve.json only")
    cur.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    return parser


def cmd_run(args) -> int:
    cmd = _command(args)
    bps, device = _throttle(args)
    result = run_limited(cmd, args.limit, bps, device, timeout=args.timeout)
    sys.stdout.write(result.stdout)
    return 0 if _report(result, args.expect) else 1


def cmd_bisect(args) -> int:
    cmd = _command(args)
    bps, device = _throttle(args)

    def passes(limit):
        result = run_limited(cmd, limit, bps, device, timeout=args.timeout)
        ok = _report(result, args.expect)
        print(f"  at {limit // MiB} MiB", flush=True)
        return ok, result.status

    found = bisect_min_limit(passes, args.lo, args.hi, args.resolution)
    print(f"minimum hard limit: {found.describe()}")
    return 0 if found.min_bytes is not None else 1


def cmd_rows(args) -> int:
    from membound_integration.budget import suite
    from membound_integration.demo import _row_functions

    order = [r for _, r in _row_functions()]
    if not args.render_only:
        wanted = [(m, r) for m, r in _row_functions() if not args.rows or r in args.rows]
        unknown = set(args.rows or []) - {r for _, r in wanted}
        if unknown:
            raise ValueError(f"unknown rows {sorted(unknown)}; rows are {order}")
        suite.run(wanted, args.profiles, not args.no_bisect, args.timeout)
    suite.render(suite.load_raw(), order)
    if not args.render_only and not args.rows and not args.no_bisect:
        # The whole run (`hatch run budget`) draws the curve too.
        return cmd_curve(
            argparse.Namespace(rows=None, limits=None, render_only=False, timeout=args.timeout)
        )
    return 0


def cmd_curve(args) -> int:
    from membound_integration.budget import curve

    if args.render_only:
        data = curve.load()
    else:
        data = curve.measure(args.rows or curve.ROWS, args.limits or curve.LIMITS_MIB, args.timeout)
    path = curve.write_svg(data)
    print(f"budget curve: {path}" if path else "budget curve: no points measured yet")
    return 0


def _command(args) -> list[str]:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ValueError("no command given (put it after --)")
    return cmd


def _throttle(args):
    if args.read_mbps is None:
        return None, None
    return int(args.read_mbps * MB), block_device_of(args.device_path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "bisect", "rows", "curve", "-h", "--help"):
        argv = ["rows", *argv]  # `hatch run budget [--rows ...]`
    args = parser.parse_args(argv)
    try:
        commands = {"run": cmd_run, "bisect": cmd_bisect, "rows": cmd_rows, "curve": cmd_curve}
        return commands[args.command](args)
    except CgroupUnavailable as exc:
        print(f"budget: no hard limit can be set here: {exc}", file=sys.stderr)
        return 2
    except MappedElsewhere as exc:
        print(f"budget: not measured: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"budget: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
