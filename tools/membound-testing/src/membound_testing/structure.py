"""The import graph of one package, for each package's tests/test_structure.py (imports run
one way) and the integration package's whole-tree test.

Imports are read from the source (ast), at every depth: at the top, in function bodies and
under TYPE_CHECKING alike."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType


def imported(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from a import b`` gives a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def import_graph(package: ModuleType) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` (an imported top-level package) it imports."""
    root = Path(package.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: (imported(path) & set(modules)) - {name} for name, path in modules.items()}


def reachable(graph: dict[str, set[str]], start: str, top: str) -> set[str]:
    """Modules ``start`` imports, directly or through others, not through ``top`` (the
    package's __init__, which re-exports the API and is imported by nothing inside)."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen - {top}:
            seen.add(dep)
            todo.append(dep)
    return seen
