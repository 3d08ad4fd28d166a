"""A sparsified model saves through the package's own path (convert + load_sparse) into
identical logits; save_pretrained, state_dict and dtype/device moves refuse clearly (#19),
where they used to write a checkpoint without MLP weights or do nothing."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import make_tiny_llama

from paired_cache import (
    PairedCacheError,
    SparseMLP,
    convert,
    load_sparse,
    save_dense,
    sparsify_model,
)

IDS = torch.arange(3, 40).unsqueeze(0)  # (1, 37)


@pytest.fixture
def sparse_model():
    model = make_tiny_llama()
    sparsify_model(model, "cats", 0.5)
    return model


def test_save_pretrained_refuses_and_writes_nothing(sparse_model, tmp_path):
    out = tmp_path / "saved"
    with pytest.raises(PairedCacheError, match=r"load_sparse.*|convert") as err:
        sparse_model.save_pretrained(out)
    assert "paired_cache.convert" in str(err.value) and "load_sparse" in str(err.value)
    assert not out.exists()


def test_state_dict_saving_refuses(sparse_model, tmp_path):
    from safetensors.torch import save_model

    with pytest.raises(PairedCacheError, match=r"model\.layers\.0\.mlp: a SparseMLP keeps"):
        sparse_model.state_dict()
    with pytest.raises(PairedCacheError, match=r"paired_cache\.convert"):
        torch.save(sparse_model.model.layers[1].state_dict(), tmp_path / "x.pt")
    with pytest.raises(PairedCacheError, match=r"paired_cache\.convert"):
        save_model(sparse_model, str(tmp_path / "x.safetensors"))
    assert not (tmp_path / "x.pt").exists() or (tmp_path / "x.pt").stat().st_size == 0


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.double(),
        lambda m: m.model.to(torch.bfloat16),  # a submodule: refused at its first SparseMLP
        lambda m: m.model.layers[0].mlp.to(torch.float16),
    ],
)
def test_dtype_moves_refuse(sparse_model, move):
    with pytest.raises(PairedCacheError, match=r"cannot become torch\.(bfloat16|float16|float64)"):
        move(sparse_model)


def test_a_refused_root_move_converts_nothing(sparse_model):
    before = sparse_model(IDS).logits
    with pytest.raises(PairedCacheError):
        sparse_model.to(torch.bfloat16)
    assert {p.dtype for p in sparse_model.parameters()} == {torch.float32}
    assert {b.dtype for b in sparse_model.buffers() if b.is_floating_point()} == {torch.float32}
    # Not bit-equal: the caches' active rows now sit in another order (paired replacement).
    torch.testing.assert_close(sparse_model(IDS).logits, before, rtol=0, atol=1e-6)


def test_moves_that_change_nothing_still_work(sparse_model):
    before = sparse_model(IDS).logits
    assert sparse_model.to("cpu") is sparse_model
    sparse_model.to(torch.float32).float()
    torch.testing.assert_close(sparse_model(IDS).logits, before, rtol=0, atol=1e-6)


def test_the_package_save_path_round_trips_into_identical_logits(tmp_path):
    dense = make_tiny_llama()
    dense.save_pretrained(tmp_path / "model")  # the dense model, before sparsify_model
    convert(tmp_path / "model", tmp_path / "model.pcpool", progress=False)
    sparse = copy.deepcopy(dense)
    sparsify_model(sparse, "cats", 0.5)
    loaded = load_sparse(
        tmp_path / "model", tmp_path / "model.pcpool", "cats", 0.5, rows="copy", prefill="sparse"
    )
    assert all(isinstance(layer.mlp, SparseMLP) for layer in loaded.model.layers)
    with torch.no_grad():
        want, got = sparse(IDS).logits, loaded(IDS).logits
        assert not torch.equal(want, dense(IDS).logits)  # the masks changed something
    # The same masks and rows. Not bit-equal: the loaded model scores with gate_proj mapped
    # from the safetensors, 8 bytes past a 64-byte boundary, the in-memory one with the
    # pool's 64-byte aligned gate block, and the CPU GEMV rounds by the address mod 64.
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(loaded.model.layers, sparse.model.layers, strict=True):
        assert torch.equal(a.mlp.cache.mask(), b.mlp.cache.mask())
    with pytest.raises(PairedCacheError, match=r"save_pretrained: .*load_sparse"):
        loaded.save_pretrained(tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_save_dense_writes_a_directory_load_sparse_reads(tmp_path):
    dense = make_tiny_llama()
    old = os.umask(0o022)
    try:
        path = save_dense(dense, tmp_path / "model")
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert path.stat().st_mode & 0o777 == 0o755
    assert (path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    convert(path, tmp_path / "model.pcpool", progress=False)
    loaded = load_sparse(
        path, tmp_path / "model.pcpool", "cats", 1.0, rows="copy", prefill="sparse"
    )
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, dense(IDS).logits, rtol=0, atol=1e-5)


def test_save_dense_refuses_a_sparse_model_or_an_existing_directory(sparse_model, tmp_path):
    with pytest.raises(PairedCacheError, match=r"save_dense: a SparseMLP keeps"):
        save_dense(sparse_model, tmp_path / "model")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(PairedCacheError, match=r"taken already exists"):
        save_dense(make_tiny_llama(), tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
