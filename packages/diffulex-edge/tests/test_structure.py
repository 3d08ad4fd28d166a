"""Imports run one way inside the package: no module reaches itself through others (counting
imports inside functions too), and the record beside a program (pte_record) reads the
program's constants from program_meta, not from the exporter. The top level exports what a
user calls (#56); the building blocks stay in their modules."""

from __future__ import annotations

import importlib
import importlib.util
from importlib.resources import files
from pathlib import Path
from types import ModuleType

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


# The names 0.9.0 took off the top level, and the modules that hold them (CHANGELOG).
MOVED = {
    "diffulex_edge.backends": ["Backend", "EagerBlockKV", "EagerCacheIO", "StaticBackend"],
    "diffulex_edge.config": ["SDARConfig", "sdar_1p7b_config", "tiny_config"],
    "diffulex_edge.export": ["EXPORT_VARIANTS", "QUANTIZATIONS", "ExportResult", "quantize_8da4w"],
    "diffulex_edge.generate": ["GenerationResult"],
    "diffulex_edge.kv_cache": ["DynamicKVCache", "StaticCacheLayout"],
    "diffulex_edge.masks": ["CacheIOMasks", "block_attention_mask", "cache_io_masks"],
    "diffulex_edge.model": ["SDARModel"],
    "diffulex_edge.remasking": ["REMASKING"],
    "diffulex_edge.sampling": ["SamplingConfig"],
}


def test_the_top_level_is_what_a_user_calls():
    """About a dozen names (CONVENTIONS.md), each resolving; the namespace holds nothing
    public beyond them but the submodules it imported."""
    names = diffulex_edge.__all__
    assert len(names) <= 15, names
    assert len(set(names)) == len(names)
    for name in names:
        assert getattr(diffulex_edge, name) is not None, name
    public = {
        name
        for name, value in vars(diffulex_edge).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    }
    assert public == set(names) - {"__version__"}


def test_the_building_blocks_live_in_their_modules():
    for module, names in MOVED.items():
        for name in names:
            assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
            assert not hasattr(diffulex_edge, name), name


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_the_toy_model_and_the_test_models_are_not_in_the_package():
    """#56: the sorting task, its training, its checkpoint and the test-model builder left
    the package for benchmarks/ (test_packaging checks the built wheel's file list)."""
    for module in ("diffulex_edge.task", "diffulex_edge.train"):
        assert importlib.util.find_spec(module) is None, module
    assert not hasattr(importlib.import_module("diffulex_edge.model"), "random_model")
    assert not hasattr(importlib.import_module("diffulex_edge.cli"), "trained_checkpoint")
    package = files("diffulex_edge")
    assert not package.joinpath("checkpoints").is_dir()
    assert not [p.name for p in package.iterdir() if p.name.endswith(".safetensors")]
    for name in ("sort_task.py", "train_sort.py", "sort_bench.py", "random_sdar.py"):
        assert (BENCHMARKS / name).is_file(), name
    assert (BENCHMARKS / "checkpoints" / "sort8" / "model.safetensors").is_file()
