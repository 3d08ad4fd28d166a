"""Imports run one way inside the package: no module reaches itself through others (counting
imports inside functions too), and the record beside a program (pte_record) reads the
program's constants from program_meta, not from the exporter."""

from __future__ import annotations

import diffulex_edge
from membound_testing import structure


def import_graph() -> dict[str, set[str]]:
    return structure.import_graph(diffulex_edge)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    return structure.reachable(graph, start, "diffulex_edge")


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert len(graph) > 20  # the scan found the package's modules
    for name in graph:
        assert name not in reachable(graph, name), f"{name} imports itself through others"


def test_the_program_record_does_not_import_the_exporter():
    graph = import_graph()
    assert "diffulex_edge.program_meta" in graph["diffulex_edge.pte_record"]
    assert "diffulex_edge.export" not in reachable(graph, "diffulex_edge.pte_record")
