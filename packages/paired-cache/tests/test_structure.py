"""Imports run one way (errors/config/mlp_layouts <- mask_sources <- trained_predictor <-
registry <- sparse_* <- model_io <- cli), counting the imports inside functions; the
top-level API is small and the building blocks are where the README says."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import paired_cache
from membound_testing import structure

PACKAGE = Path(paired_cache.__file__).parent


def import_graph() -> dict[str, set[str]]:
    return structure.import_graph(paired_cache)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    return structure.reachable(graph, start, "paired_cache")


def test_the_package_imports_no_cycle():
    graph = import_graph()
    for name in graph:
        if name != "paired_cache":
            assert name not in reachable(graph, name), f"{name} imports itself through others"


def test_nothing_inside_imports_the_package_init():
    graph = import_graph()
    assert not [name for name, deps in graph.items() if "paired_cache" in deps]


@pytest.mark.parametrize(
    "module, below",
    [
        # The sources know neither the registry nor the modules that use them.
        ("paired_cache.mask_sources", {"registry", "trained_predictor", "sparse_mlp"}),
        ("paired_cache.trained_predictor", {"registry", "sparse_mlp", "model_io"}),
        ("paired_cache.registry", {"sparse_mlp", "sparse_ffn", "model_io", "cli"}),
        ("paired_cache.sparse_mlp", {"model_io", "read_ahead", "cli"}),
        ("paired_cache.read_ahead", {"model_io", "sparse_mlp", "registry", "cli"}),
        ("paired_cache.cache", {"mask_sources", "sparse_mlp", "model_io"}),
    ],
)
def test_layers_do_not_import_upwards(module, below):
    reached = reachable(import_graph(), module)
    assert not {f"paired_cache.{m}" for m in below} & reached


def test_the_graph_sees_function_level_imports():
    # Guards the tests above against a graph that silently misses modules or imports.
    graph = import_graph()
    assert len(graph) == len(list(PACKAGE.glob("*.py")))
    assert "paired_cache.trained_predictor" in graph["paired_cache.registry"]
    assert "paired_cache.model_io" in graph["paired_cache.cli"]  # inside cmd_convert


def test_the_registry_holds_every_source():
    from paired_cache.mask_sources import MaskSource
    from paired_cache.registry import MASK_SOURCES

    assert set(MASK_SOURCES) == {"oracle", "cats", "lowrank", "fixed", "trained"}
    assert all(issubclass(cls, MaskSource) for cls in MASK_SOURCES.values())
    assert paired_cache.MASK_SOURCES is MASK_SOURCES


def test_the_top_level_api_is_small_and_complete():
    names = paired_cache.__all__
    assert len(names) <= 15, names
    assert len(set(names)) == len(names)
    assert all(hasattr(paired_cache, name) for name in names)
    errors = [getattr(paired_cache, n) for n in names if n.endswith("Error")]
    assert errors == [paired_cache.PairedCacheError]
    assert not hasattr(paired_cache, "CacheConfig")  # renamed PairedCacheConfig in 0.17


def test_the_building_blocks_are_importable_where_the_readme_says():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = re.findall(r"^- `(paired_cache\.[\w.]+)`: (.+)$", readme, re.M)
    assert len(listed) >= 6, "the README's API section lists the building blocks' modules"
    for module, names in listed:
        imported = importlib.import_module(module)
        for name in re.findall(r"`(\w+)`", names):
            assert hasattr(imported, name), f"{module}.{name}, listed in the README"
            assert name not in paired_cache.__all__, f"{name} is top level, not a building block"
