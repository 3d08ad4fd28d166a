"""The support matrix: which model families a package works on, and which it refuses by name.

A package's ``tests/test_support_matrix.py`` builds a tiny random-weights model of each
family offline from its config class, asserts the package's promise on it (or that the
package refuses it with its own error before changing anything) and records the outcome
here. ``tools/support_matrix.py`` runs those tests with ``MEMBOUND_SUPPORT_OUT`` set,
keeps the records as ``packages/<package>/benchmarks/support_matrix.json`` and
renders the README tables from them, so a table says only what a test saw.

Usage in a test::

    from membound_testing.support import record

    def test_logits_identical(family):
        model = tiny_model(family)
        ...  # assert the promise
        record("zstd-linear", family, "bit-identical logits")

    def test_refused(family):
        with pytest.raises(PackageError, match=family) as info:
            ...
        record("zstd-linear", family, "bit-identical logits", refused=info.value)

A record is written only after the test's assertions passed, so a failing test leaves no
"works" behind. Without ``MEMBOUND_SUPPORT_OUT`` :func:`record` does nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

OUT_ENV = "MEMBOUND_SUPPORT_OUT"
WORKS = "yes"


def record(package: str, family: str, promise: str, refused: BaseException | None = None) -> None:
    """Note that ``package`` keeps ``promise`` on ``family`` (or refuses it with ``refused``).

    Args:
        package: the distribution name, e.g. ``"zstd-linear"``.
        family: the transformers ``model_type`` (or mlx-lm model file), e.g. ``"gemma2"``.
        promise: the column of the table, e.g. ``"bit-identical logits"``.
        refused: the package's own exception when the family is refused; its message is
            the cell (the first line, as a user would see it).
    """
    path = os.environ.get(OUT_ENV)
    if not path:
        return
    cell = WORKS if refused is None else "refused: " + str(refused).splitlines()[0]
    line = json.dumps({"package": package, "family": family, "promise": promise, "cell": cell})
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def load_records(path: str | os.PathLike) -> list[dict]:
    """The records of a ``MEMBOUND_SUPPORT_OUT`` file (one JSON object a line)."""
    text = Path(path).read_text(encoding="utf-8") if Path(path).is_file() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def matrix(records: list[dict]) -> dict:
    """``{"families": [...], "promises": [...], "cells": {family: {promise: cell}}}``, in the
    order the records first name each family and promise. A (family, promise) recorded
    twice keeps a refusal over a ``yes`` (one failing variant makes the cell a refusal)."""
    families: list[str] = []
    promises: list[str] = []
    cells: dict[str, dict[str, str]] = {}
    for r in records:
        if r["family"] not in families:
            families.append(r["family"])
        if r["promise"] not in promises:
            promises.append(r["promise"])
        row = cells.setdefault(r["family"], {})
        if row.get(r["promise"], WORKS) == WORKS:
            row[r["promise"]] = r["cell"]
    return {"families": families, "promises": promises, "cells": cells}


def markdown(m: dict) -> str:
    """The support table of a :func:`matrix`: one row a family, one column a promise; a
    cell no test recorded reads "not tested"."""
    from membound_testing.results import markdown_table

    rows = [
        [f"`{fam}`"] + [m["cells"].get(fam, {}).get(p, "not tested") for p in m["promises"]]
        for fam in m["families"]
    ]
    return markdown_table(["family", *m["promises"]], rows)


def summary(m: dict) -> str:
    """One line: the families where every promise holds, those where some are refused, and
    those refused outright."""

    def cells(family):
        return list(m["cells"].get(family, {}).values())

    full = [f for f in m["families"] if all(v == WORKS for v in cells(f))]
    refused = [f for f in m["families"] if not any(v == WORKS for v in cells(f))]
    partly = [f for f in m["families"] if f not in full and f not in refused]
    line = ", ".join(full) if full else "none"
    if partly:
        line += f"; partly (some promises refused by name): {', '.join(partly)}"
    if refused:
        line += f"; refused by name: {', '.join(refused)}"
    return line
