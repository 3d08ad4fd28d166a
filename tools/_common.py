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


def replace_section(path: Path, body: str, start: str, end: str) -> bool:
    """Replace what lies between the ``start`` and ``end`` marker lines of ``path`` (through
    a temporary file and a rename); False if it has none."""
    text = path.read_text(encoding="utf-8")
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(f"{head}{start}\n{body.strip()}\n{end}{tail}", encoding="utf-8")
    tmp.replace(path)
    return True
