"""Run every zstd-linear benchmark and write results/*.json (tools/bench.py renders them).

hatch run zstd-linear:bench            # full
hatch run zstd-linear:bench --quick    # smoke run (fewer repeats, smaller workloads)
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import budget_sweep  # noqa: E402
import codec  # noqa: E402
import end_to_end  # noqa: E402
import fuzz  # noqa: E402
import planes  # noqa: E402


def main() -> None:
    quick = "--quick" in sys.argv
    repeats = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--repeats=")), None)
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not only or "codec" in only:
        codec.run(quick=quick)
    if not only or "end_to_end" in only:
        end_to_end.run(quick=quick, repeats=repeats)
    if not only or "budget_sweep" in only:
        budget_sweep.run(quick=quick, repeats=repeats)
    if not only or "planes" in only:
        planes.main()
    if not only or "fuzz" in only:
        fuzz.run(mutants=200 if quick else 2000, save=not quick)


if __name__ == "__main__":
    main()
