"""Imports run one way inside the package: no module reaches itself through others (counting
imports inside functions too), ignoring the package's __init__, which re-exports."""

from __future__ import annotations

import ast
from pathlib import Path

import bmrt_kv

PACKAGE = Path(bmrt_kv.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere (top level and function bodies)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules)
        graph[name] = deps - {name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen - {"bmrt_kv"}:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert {"bmrt_kv.cache", "bmrt_kv.hooks", "bmrt_kv.selectors.hybrid"} <= set(graph)
    for name in graph:
        if name != "bmrt_kv":
            assert name not in reachable(graph, name), f"{name} imports itself through others"


def test_the_hooks_do_not_import_the_cache_they_serve():
    assert "bmrt_kv.cache" not in reachable(import_graph(), "bmrt_kv.hooks")
