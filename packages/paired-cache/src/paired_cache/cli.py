"""``paired-cache`` command line: ``paired-cache bench`` runs the update microbenchmark."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

from paired_cache.config import CacheConfig
from paired_cache.microbench import BenchConfig, markdown, run


def _bench(args: argparse.Namespace) -> int:
    cfg = BenchConfig(steps=args.steps or (20 if args.quick else 200))
    if args.quick:
        cfg = BenchConfig(
            n_rows=2048, hidden=256, cols=256, m=256, ks=(16, 64, 256), steps=cfg.steps
        )
    threads = CacheConfig().num_threads if args.threads is None else args.threads
    result = run(cfg, threads, progress=lambda s: print(s, file=sys.stderr))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(markdown(result["columns"], result["rows"]))
    if args.json:
        payload = {k: result[k] for k in ("columns", "rows")}
        directory = os.path.dirname(os.path.abspath(args.json))
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, args.json)  # never a half-written file
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paired-cache")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time cache updates against rebuild baselines")
    bench.add_argument("--quick", action="store_true", help="small sizes, few steps")
    bench.add_argument("--steps", type=int, default=None, help="updates per cell (default 200)")
    bench.add_argument(
        "--threads", type=int, default=None, help="copy threads and torch threads (default: cores)"
    )
    bench.add_argument("--json", default=None, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
