"""The READMEs' support tables are what `hatch run support` rendered from the records of the
packages' support-matrix tests (packages/<p>/benchmarks/support_matrix.json): no cell is
typed by hand, and a package with such tests has its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from membound_testing.support import markdown, summary

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "README.md").is_file())


def _section(readme: Path) -> str:
    text = readme.read_text(encoding="utf-8")
    assert START in text and END in text, f"{readme}: no support-matrix markers"
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def _matrix(package: str) -> dict | None:
    path = ROOT / "packages" / package / "benchmarks" / "support_matrix.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


@pytest.mark.parametrize("package", PACKAGES)
def test_package_table_is_the_rendered_records(package):
    tests = ROOT / "packages" / package / "tests" / "test_support_matrix.py"
    m = _matrix(package)
    if not tests.is_file():
        assert m is None, f"{package}: support_matrix.json without the tests that write it"
        return
    assert m is not None, f"{package}: run `hatch run support --only {package}`"
    readme = ROOT / "packages" / package / "README.md"
    assert _section(readme) == markdown(m), f"{readme}: re-render with `hatch run support`"
    # Every family has a cell for every promise: a test that stopped recording shows here.
    for family in m["families"]:
        assert set(m["cells"][family]) == set(m["promises"]), (package, family)


def test_root_summary_is_the_rendered_records():
    lines = [f"- `{p}`: {summary(m)}" for p in PACKAGES if (m := _matrix(p)) is not None]
    assert _section(ROOT / "README.md") == "\n".join(lines)
