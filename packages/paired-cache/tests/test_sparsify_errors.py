"""sparsify_model's refusals name the cause (#19): 1-D calibration ids are one sequence, a
second sparsify, a too-short calibration and accelerate-offloaded weights are refused
before the model changes."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from paired_cache import PairedCacheError, SparseMLP, sparsify_model
from paired_cache.sparse_mlp import MIN_CALIBRATION_TOKENS

IDS = torch.arange(3, 43).unsqueeze(0)  # (1, 40)


def _mlp_types(model) -> list[str]:
    return [type(layer.mlp).__name__ for layer in model.model.layers]


def test_one_dimensional_calibration_ids_are_one_sequence():
    flat, batched = make_tiny_llama(), make_tiny_llama()
    a = sparsify_model(flat, "fixed", 0.25, calibration_ids=IDS[0])
    b = sparsify_model(batched, "fixed", 0.25, calibration_ids=IDS)
    assert all(torch.equal(x.source.mask, y.source.mask) for x, y in zip(a, b, strict=True))
    a = sparsify_model(make_tiny_llama(), "lowrank", 0.25, calibration_ids=IDS[0])
    assert all(s.source.rank == 32 for s in a)  # min(128, T=40, hidden=32, N=64)


@pytest.mark.parametrize(
    "ids, match",
    [
        (IDS.float(), r"calibration_ids must be an integer tensor"),
        (IDS.tolist(), r"calibration_ids must be an integer tensor of token ids.*got list"),
        (IDS.view(1, 1, -1), r"must be \(1, T\) or \(T,\) token ids, got shape \(1, 1, 40\)"),
        (IDS[:, :3], rf"hold 3 tokens; at least {MIN_CALIBRATION_TOKENS} are needed"),
        (IDS[0, : MIN_CALIBRATION_TOKENS - 1], rf"hold {MIN_CALIBRATION_TOKENS - 1} tokens"),
    ],
)
def test_bad_calibration_ids_are_refused_before_any_change(ids, match):
    model = make_tiny_llama()
    with pytest.raises(PairedCacheError, match=match):
        sparsify_model(model, "lowrank", 0.5, calibration_ids=ids)
    assert _mlp_types(model) == ["LlamaMLP", "LlamaMLP"]


def test_the_documented_minimum_is_accepted():
    model = make_tiny_llama()
    sparsify_model(model, "fixed", 0.5, calibration_ids=IDS[:, :MIN_CALIBRATION_TOKENS])
    assert _mlp_types(model) == ["SparseMLP", "SparseMLP"]


def test_a_calibration_source_without_ids_is_refused_by_name():
    model = make_tiny_llama()
    with pytest.raises(PairedCacheError, match=r"'lowrank' needs calibration_ids"):
        sparsify_model(model, "lowrank", 0.5)
    assert _mlp_types(model) == ["LlamaMLP", "LlamaMLP"]


def test_sparsifying_twice_says_already_sparsified():
    model = make_tiny_llama()
    first = sparsify_model(model, "cats", 0.5)
    with pytest.raises(PairedCacheError, match=r"already sparsified \(2 SparseMLP modules"):
        sparsify_model(model, "cats", 0.25)
    assert [layer.mlp for layer in model.model.layers] == first
    with pytest.raises(PairedCacheError, match=r"already a SparseMLP"):
        SparseMLP.from_mlp(first[0], "cats", 0.5)


def test_unknown_source_is_refused_before_the_calibration_forward():
    model = make_tiny_llama()
    calls = []
    model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(PairedCacheError, match=r"unknown mask source 'topk'"):
        sparsify_model(model, "topk", 0.5, calibration_ids=IDS)
    assert calls == []


def test_accelerate_disk_offload_is_refused_by_name(tmp_path):
    from accelerate import disk_offload

    model = make_tiny_llama()
    disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    assert model.model.layers[0].mlp.gate_proj.weight.is_meta
    with pytest.raises(PairedCacheError, match=r"offloaded weights are not supported") as err:
        sparsify_model(model, "cats", 0.5)
    assert "model.layers.0.mlp" in str(err.value) and "load_sparse" in str(err.value)
    assert _mlp_types(model) == ["LlamaMLP", "LlamaMLP"]
