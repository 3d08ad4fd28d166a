"""Dependencies point one way: layer -> its runtime's interface, runtime -> policy,
policy -> BackingStore; a layer built alone sets nothing on itself; the top-level API is
small and the building blocks are where the README says; bad arguments raise the
package's own error type."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import make_toy

import zstd_linear
from membound_testing import structure
from zstd_linear import POLICIES, CompressedLinear, compress_model, decompress_model

PACKAGE = Path(zstd_linear.__file__).parent


def import_graph() -> dict[str, set[str]]:
    return structure.import_graph(zstd_linear)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    return structure.reachable(graph, start, "zstd_linear")


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


def test_the_layer_does_not_import_its_runtime_or_the_policies():
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
    assert layer._runtime is None


def test_the_runtime_binds_its_layers_and_decompress_unbinds_them():
    plain, model = make_toy(), make_toy()
    compress_model(model, policy="none")
    runtime = model.zstd_linear_runtime
    layers = {n: m for n, m in model.named_modules() if isinstance(m, CompressedLinear)}
    assert layers and all(m._runtime is runtime for m in layers.values())
    assert set(runtime.layers) == set(layers)
    decompress_model(model)
    with torch.no_grad():
        for name, layer in layers.items():
            assert layer._runtime is None
            x = torch.randn(2, layer.in_features)
            # Unbound, it decodes itself: still the plain layer's output.
            assert torch.equal(layer(x), plain.get_submodule(name)(x))


def test_the_top_level_api_is_small_and_complete():
    names = zstd_linear.__all__
    assert len(names) <= 15, names
    assert len(set(names)) == len(names)
    assert all(hasattr(zstd_linear, name) for name in names)
    errors = [getattr(zstd_linear, n) for n in names if n.endswith("Error")]
    assert errors and all(issubclass(e, zstd_linear.ZstdLinearError) for e in errors)


def test_the_building_blocks_are_importable_where_the_readme_says():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = re.findall(r"^- `(zstd_linear\.[\w.]+)`: (.+)$", readme, re.M)
    assert len(listed) >= 5, "the README's API section lists the building blocks' modules"
    for module, names in listed:
        imported = importlib.import_module(module)
        for name in re.findall(r"`(\w+)`", names):
            assert hasattr(imported, name), f"{module}.{name}, listed in the README"
            assert name not in zstd_linear.__all__, f"{name} is top level, not a building block"


def test_no_bare_value_or_type_error_is_raised():
    # Bad arguments raise ZstdLinearError (a ValueError), so that callers can tell
    # zstd-linear's refusals from any other ValueError.
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in ("ValueError", "TypeError"):
                bare.append(f"{path.relative_to(PACKAGE)}:{node.lineno} raise {exc.id}")
    assert len(list(PACKAGE.rglob("*.py"))) > 20  # the scan sees the package's modules
    assert not bare, f"raise ZstdLinearError (zstd_linear.errors) instead: {bare}"
