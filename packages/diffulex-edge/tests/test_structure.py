"""Imports run one way inside the package: no module reaches itself through others (counting
imports inside functions too), and the record beside a program (pte_record) reads the
program's constants from program_meta, not from the exporter."""

from __future__ import annotations

import ast
from pathlib import Path

import diffulex_edge

PACKAGE = Path(diffulex_edge.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere (top level and function bodies)."""
    names = {f"diffulex_edge.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in names)
        graph[name] = deps - {name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert len(graph) > 20  # the scan found the package's modules
    for name in graph:
        assert name not in reachable(graph, name), f"{name} imports itself through others"


def test_the_program_record_does_not_import_the_exporter():
    graph = import_graph()
    assert "diffulex_edge.program_meta" in graph["diffulex_edge.pte_record"]
    assert "diffulex_edge.export" not in reachable(graph, "diffulex_edge.pte_record")
