"""Dependencies point one way: layer -> its container's interface, runtime -> policy,
policy -> BackingStore; and a layer built alone sets nothing on itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import make_toy

import zstd_linear
from zstd_linear import POLICIES, CompressedLinear, compress_model, decompress_model

PACKAGE = Path(zstd_linear.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere: at the top, in function
    bodies and under TYPE_CHECKING alike."""
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
    """Modules ``start`` imports, directly or through others, not through the package's
    __init__ (which re-exports everything and is imported by nothing inside)."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen - {"zstd_linear"}:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_the_package_imports_no_cycle():
    graph = import_graph()
    for name in graph:
        if name != "zstd_linear":
            assert name not in reachable(graph, name), f"{name} imports itself through others"


@pytest.mark.parametrize(
    "module",
    ["zstd_linear.policies"]
    + [f"zstd_linear.policies.{p.stem}" for p in (PACKAGE / "policies").glob("[!_]*.py")],
)
def test_policies_import_neither_the_runtime_nor_the_modules(module):
    reached = reachable(import_graph(), module)
    for banned in ("runtime", "layer", "embedding", "model", "serialize"):
        assert f"zstd_linear.{banned}" not in reached


def test_the_layer_does_not_import_its_container_or_the_policies():
    reached = reachable(import_graph(), "zstd_linear.layer")
    assert "zstd_linear.runtime" not in reached
    assert not any(m.startswith("zstd_linear.policies") for m in reached)


def test_the_runtime_module_is_in_the_graph():
    # Guards the two tests above against a graph that silently misses modules.
    graph = import_graph()
    assert "zstd_linear.policies" in graph["zstd_linear.runtime"]
    assert "zstd_linear.layer" in graph["zstd_linear.runtime"]
    assert len([m for m in graph if m.startswith("zstd_linear.policies.")]) == len(POLICIES) + 1


def test_a_standalone_layer_sets_nothing_on_itself():
    linear = nn.Linear(16, 8)
    layer = CompressedLinear.from_linear(linear, name="proj")
    before = dict(vars(layer))
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(layer(x), linear(x))
    after = vars(layer)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert layer._container is None


def test_the_runtime_binds_its_layers_and_decompress_unbinds_them():
    plain, model = make_toy(), make_toy()
    compress_model(model, policy="none")
    runtime = model.zstd_linear_runtime
    layers = {n: m for n, m in model.named_modules() if isinstance(m, CompressedLinear)}
    assert layers and all(m._container is runtime for m in layers.values())
    assert set(runtime.layers) == set(layers)
    decompress_model(model)
    with torch.no_grad():
        for name, layer in layers.items():
            assert layer._container is None
            x = torch.randn(2, layer.in_features)
            # Unbound, it decodes itself: still the plain layer's output.
            assert torch.equal(layer(x), plain.get_submodule(name)(x))
