"""Imports run one way inside the package (#56), counting imports inside functions and
leaving out the package's __init__, which re-exports: no module reaches itself through
others; the policies see only the error type; the offline tools (router traces, profiles,
the simulator) replay a trace without ever reaching the model runtime; the storage layer
does not import the cache it feeds; the cached layers and blocks do not import what
composes them. The runtime wheel holds runtime code (the MoE builder is
membound_testing.moefy), and the top level exports what a user calls."""

from __future__ import annotations

import importlib
from pathlib import Path

import moe_expert_cache
from membound_testing import structure

PACKAGE = Path(moe_expert_cache.__file__).parent
TOP = "moe_expert_cache"


def import_graph() -> dict[str, set[str]]:
    return structure.import_graph(moe_expert_cache)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    return structure.reachable(graph, start, TOP)


def names(*modules: str) -> set[str]:
    return {f"{TOP}.{m}" for m in modules}


# What loads and runs a model: the shards, the store, the cached layers and blocks, the
# manager and the loop.
RUNTIME = names(
    "safetensors_io",
    "expert_store",
    "mapped_embedding",
    "cached_layers",
    "layer_cache",
    "prefetch",
    "moe_blocks",
    "deepseek_blocks",
    "block_registry",
    "manager",
    "loader",
    "generate",
)


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    assert RUNTIME | names("policies", "slots", "trace", "simulator", "cli") <= set(graph)
    for name in graph:
        if name != TOP:
            assert name not in reachable(graph, name), f"{name} imports itself through others"


def test_the_policies_see_only_the_error_type():
    graph = import_graph()
    assert reachable(graph, f"{TOP}.policies") == names("errors")
    assert reachable(graph, f"{TOP}.slots") == names("errors", "policies")


def test_the_offline_tools_never_reach_the_model_runtime():
    graph = import_graph()
    for module in ("trace", "profile", "simulator", "policies", "slots", "config"):
        reached = reachable(graph, f"{TOP}.{module}") & RUNTIME
        assert not reached, f"{module} reaches {sorted(reached)}"


def test_the_storage_layer_does_not_import_the_cache_it_feeds():
    graph = import_graph()
    cache = names("policies", "slots", "trace", "config", "cli") | RUNTIME
    cache -= names("safetensors_io", "expert_store")
    for module in ("checked_json", "safetensors_io", "expert_store", "mapped_embedding"):
        reached = reachable(graph, f"{TOP}.{module}") & cache
        assert not reached, f"{module} reaches {sorted(reached)}"


def test_the_cached_layers_and_blocks_do_not_import_what_composes_them():
    graph = import_graph()
    composers = names("manager", "loader", "generate", "cli")
    for module in ("layer_cache", "cached_layers", "prefetch", "moe_blocks", "block_registry"):
        reached = reachable(graph, f"{TOP}.{module}") & composers
        assert not reached, f"{module} reaches {sorted(reached)}"
    importers = [name for name, deps in graph.items() if f"{TOP}.cli" in deps]
    assert importers == [], f"{importers} import the CLI"


def test_the_runtime_wheel_holds_no_test_model_builder():
    """MoEfication and its calibration text are membound_testing.moefy (0.10.0); nothing in
    the package imports the dev helper."""
    assert not (PACKAGE / "moefy.py").exists()
    assert not (PACKAGE / "calibration.py").exists()
    for path in PACKAGE.rglob("*.py"):
        roots = {name.split(".")[0] for name in structure.imported(path)}
        assert "membound_testing" not in roots, path.name
        assert not {"moe_expert_cache.moefy", "moe_expert_cache.calibration"} & (
            structure.imported(path)
        ), path.name


def test_the_public_api_is_what_a_user_calls():
    """At most a dozen top-level names (#56); the building blocks stay in their modules."""
    assert len(moe_expert_cache.__all__) <= 12
    assert len(set(moe_expert_cache.__all__)) == len(moe_expert_cache.__all__)
    for name in moe_expert_cache.__all__:
        assert getattr(moe_expert_cache, name) is not None, name
    public = {n for n in vars(moe_expert_cache) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(moe_expert_cache, n)).__name__ == "module"}
    assert public - modules == set(moe_expert_cache.__all__) - {"__version__"}
    documented = {
        "config": ["MODES", "DEFAULT_CAPACITY_SHARE"],
        "policies": ["POLICIES"],
        "profile": ["adaptive_capacity", "pinned_experts"],
        "simulator": ["SIMULATED", "simulate"],
        "trace": ["RouterTrace"],
    }
    for module, names_ in documented.items():
        mod = importlib.import_module(f"moe_expert_cache.{module}")
        for name in names_:
            assert hasattr(mod, name), f"moe_expert_cache.{module}.{name}"
    errors = [getattr(moe_expert_cache, n) for n in moe_expert_cache.__all__ if n.endswith("Error")]
    assert errors and all(issubclass(e, moe_expert_cache.ExpertCacheError) for e in errors)
