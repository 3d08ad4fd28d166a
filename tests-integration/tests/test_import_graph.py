"""The import graph of the whole tree (#56): the packages, their tests and benchmarks, tools/
(membound-testing among them) and the integration package. Imports inside functions count.

- No package module reaches itself through others (each package's __init__, which
  re-exports, left out).
- No package imports another package of the repo: stacking glue lives in tests-integration.
- Nothing below the integration package imports it: not the packages, their tests or
  benchmarks, nor tools/ (the budget runner the benchmarks use is membound_testing.budget).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from membound_testing.structure import imported

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "bmrt_kv": "bmrt-kv",
    "diffulex_edge": "diffulex-edge",
    "moe_expert_cache": "moe-expert-cache",
    "paired_cache": "paired-cache",
    "zstd_linear": "zstd-linear",
}
INTEGRATION = "membound_integration"


def package_graph(top: str) -> dict[str, set[str]]:
    src = ROOT / "packages" / PACKAGES[top] / "src"
    modules = {}
    for path in (src / top).rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: (imported(path) & set(modules)) - {name} for name, path in modules.items()}


@pytest.mark.parametrize("top", sorted(PACKAGES))
def test_no_package_module_imports_itself_through_others(top):
    graph = package_graph(top)
    for start in graph:
        if start == top:
            continue
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()] - seen - {top}:
                assert dep != start, f"{start} imports itself through {sorted(seen)}"
                seen.add(dep)
                todo.append(dep)


def _files(*folders: Path) -> list[Path]:
    return [p for folder in folders for p in folder.rglob("*.py") if ".venv" not in p.parts]


@pytest.mark.parametrize("top", sorted(PACKAGES))
def test_a_package_imports_no_other_package_of_the_repo(top):
    folder = ROOT / "packages" / PACKAGES[top]
    others = set(PACKAGES) - {top}
    for path in _files(folder / "src", folder / "tests", folder / "benchmarks"):
        roots = {name.split(".")[0] for name in imported(path)}
        assert not roots & others, f"{path.relative_to(ROOT)} imports {sorted(roots & others)}"


def test_nothing_below_the_integration_package_imports_it():
    below = _files(ROOT / "packages", ROOT / "tools")
    assert len(below) > 100  # the scan found the tree
    for path in below:
        roots = {name.split(".")[0] for name in imported(path)}
        assert INTEGRATION not in roots, f"{path.relative_to(ROOT)} imports {INTEGRATION}"


def test_the_dev_helper_imports_no_package_of_the_repo():
    """membound-testing serves every package's tests: a package it imported would be in
    every test environment (random_moe takes moe-expert-cache's seal_model as an argument)."""
    for path in _files(ROOT / "tools" / "membound-testing" / "src"):
        roots = {name.split(".")[0] for name in imported(path)}
        assert not roots & set(PACKAGES), (
            f"{path.relative_to(ROOT)} imports {roots & set(PACKAGES)}"
        )
