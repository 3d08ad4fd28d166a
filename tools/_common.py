"""What the developer scripts in tools/ share: the package list and the hatch binary."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# dist name -> import name, in the order the suite runs them.
PACKAGES = {
    "paired-cache": "paired_cache",
    "moe-expert-cache": "moe_expert_cache",
    "zstd-linear": "zstd_linear",
    "bmrt-kv": "bmrt_kv",
    "diffulex-edge": "diffulex_edge",
}


def hatch() -> str:
    """The hatch executable that runs this script (scripts run inside a hatch env)."""
    exe = shutil.which("hatch")
    if exe is None:
        sys.exit("hatch is not on PATH: `pip install hatch` first")
    return exe
