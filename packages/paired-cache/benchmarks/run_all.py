"""Run every paired-cache benchmark and write results/*.json (tools/bench.py renders them).

hatch run paired-cache:bench [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import decode  # noqa: E402
import fuzz  # noqa: E402
import memory  # noqa: E402
import quality  # noqa: E402
import update_bench  # noqa: E402
import window  # noqa: E402


def main() -> None:
    quick = "--quick" in sys.argv
    update_bench.main(quick)
    quality.main(quick)
    window.main(quick)
    memory.main(quick)
    decode.main(["--quick"] if quick else [])
    fuzz.main(["--quick"] if quick else [])


if __name__ == "__main__":
    main()
