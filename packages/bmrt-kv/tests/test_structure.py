"""Imports run one way inside the package: no module reaches itself through others (counting
imports inside functions too), ignoring the package's __init__, which re-exports. The wheel
holds the runtime only: the evaluation code lives in benchmarks/ (#56)."""

from __future__ import annotations

from pathlib import Path

import bmrt_kv
from membound_testing import structure

# The modules of the runtime. A new one is added here on purpose; evaluation suites, sample
# generators and scoring belong in benchmarks/ (ruler_suite.py, evaluation.py,
# retrieval.py), outside the wheel.
RUNTIME = {
    "bmrt_kv",
    "bmrt_kv.__about__",
    "bmrt_kv.cache",
    "bmrt_kv.cli",
    "bmrt_kv.compress",
    "bmrt_kv.config",
    "bmrt_kv.errors",
    "bmrt_kv.hooks",
    "bmrt_kv.layer",
    "bmrt_kv.rope",
    "bmrt_kv.stream",
    "bmrt_kv.support",
    "bmrt_kv.window",
    "bmrt_kv.selectors",
    "bmrt_kv.selectors.attention",
    "bmrt_kv.selectors.base",
    "bmrt_kv.selectors.exact",
    "bmrt_kv.selectors.h2o",
    "bmrt_kv.selectors.hybrid",
    "bmrt_kv.selectors.keydiff",
    "bmrt_kv.selectors.lsh",
    "bmrt_kv.selectors.magicpig",
    "bmrt_kv.selectors.registry",
    "bmrt_kv.selectors.simhash",
    "bmrt_kv.selectors.snapkv",
    "bmrt_kv.selectors.streaming",
    "bmrt_kv.selectors.tiebreak",
}
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
EVALUATION = {p.stem for p in BENCHMARKS.glob("*.py")}


def import_graph() -> dict[str, set[str]]:
    return structure.import_graph(bmrt_kv)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    return structure.reachable(graph, start, "bmrt_kv")


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert {"bmrt_kv.cache", "bmrt_kv.hooks", "bmrt_kv.selectors.hybrid"} <= set(graph)
    for name in graph:
        if name != "bmrt_kv":
            assert name not in reachable(graph, name), f"{name} imports itself through others"


def test_the_hooks_do_not_import_the_cache_they_serve():
    assert "bmrt_kv.cache" not in reachable(import_graph(), "bmrt_kv.hooks")


def test_the_package_holds_the_runtime_only():
    """What the package ships (the installed wheel under the release check) is the runtime:
    no evaluation suite or sample generator came back into src/bmrt_kv."""
    graph = import_graph()
    assert set(graph) == RUNTIME, (
        f"modules beyond the runtime: {sorted(set(graph) - RUNTIME)}; "
        f"missing: {sorted(RUNTIME - set(graph))}"
    )
    assert not any(
        part in ("suite", "evaluation", "ruler_suite", "retrieval", "passkey")
        for name in graph
        for part in name.split(".")
    )


def test_no_runtime_module_imports_the_benchmarks():
    assert {"evaluation", "ruler_suite", "retrieval"} <= EVALUATION
    root = Path(bmrt_kv.__file__).parent
    for path in root.rglob("*.py"):
        top = {name.split(".")[0] for name in structure.imported(path)}
        assert not top & EVALUATION, f"{path.name} imports {sorted(top & EVALUATION)}"
