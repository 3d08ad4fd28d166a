"""Imports run one way inside the package: no module reaches itself through others (counting
imports inside functions too), ignoring the package's __init__, which re-exports."""

from __future__ import annotations

import bmrt_kv
from membound_testing import structure


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
