"""Run every bmrt-kv benchmark; ``--quick`` runs the small subsets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["selection_time.py", "passkey.py", "stream_rss.py", "fuzz.py"]


def main() -> None:
    extra = sys.argv[1:]
    for script in BENCHMARKS:
        print(f"== {script} {' '.join(extra)}", flush=True)
        subprocess.run([sys.executable, str(HERE / script), *extra], check=True, cwd=HERE)


if __name__ == "__main__":
    main()
