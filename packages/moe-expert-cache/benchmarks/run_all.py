"""Run every moe-expert-cache benchmark (``--quick`` for a fast smoke run)."""

from __future__ import annotations

import sys

import decode_bench
import fuzz
import moefy_quality
import moefy_sweep
import prefetch_bench
import real_decode
import real_traces
import simulator_bench
from _common import COMMAND


def main() -> None:
    quick = "--quick" in sys.argv[1:]
    moefy_quality.run(quick)
    moefy_sweep.run(quick)
    real_traces.run(quick)
    real_traces.run_demo(quick)
    simulator_bench.run(quick)
    decode_bench.run(quick)
    prefetch_bench.run(quick, command=COMMAND)
    prefetch_bench.run(quick, command=COMMAND, demo=True)
    real_decode.run(quick, command=COMMAND)
    fuzz.run(100 if quick else 2000, quick=quick)


if __name__ == "__main__":
    main()
