"""The packages stacked (membound_integration.stack) on tiny random models of two families.

Invariants, over random prompts (hypothesis):
- at lossless settings (every MLP row, a KV budget above the sequence) the stacked model
  gives plain's logits within paired-cache's own float32 bound for a full mask
  (max |difference| <= 1e-5 x max |logit|, the same argmax: the SparseMLP's packed GEMMs
  round differently from the dense layout, and the in-place kernel over the mapped pool
  differently again; zstd-linear is lossless and bmrt-kv keeps every token at these
  settings), and plain's greedy tokens;
- stacking in the other order (zstd-linear compresses the plain model first, then
  paired-cache sparsifies it, its rows copied into pools) gives the same model: the same
  bound against plain, the same argmax;
- over a compressed pool (each row a zstd frame, or, for MLP weights on a GGUF grid, the
  grid's codes), with every MLP's gate_proj compressed by zstd-linear in the SparseMLP's
  place, the same bound and argmax (and the gate is zstd-linear's layer);
- a step the packages cannot combine (a .zlin that names MLP layers paired-cache has
  replaced) is refused by zstd-linear before the model changes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bmrt_kv import BMRTCache, BMRTConfig
from membound_integration.stack import (
    MLP_GLOB,
    ROWS_GLOBS,
    kv_budget,
    kv_bytes_per_token,
    load_stacked,
    room_for_rows,
    room_left,
)
from membound_testing.families import VOCAB, tiny_model
from membound_testing.grids import on_gguf_grid
from paired_cache import SparseMLP, convert, sparsify_model
from zstd_linear import CompressedFileError, CompressedLinear, compress_model, save_compressed

FAMILIES = ("llama", "qwen3")
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=FAMILIES)
def stacked(request, tmp_path_factory):
    """(family, plain model, stacked model, directory holding its files)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    plain = tiny_model(family)
    plain.save_pretrained(root / "dense")
    convert(root / "dense", root / "mlp.pcpool", gate=False, progress=False)
    # The .zlin of everything but the MLPs, and (for the refusal) of the whole model.
    for name, exclude in (("rest", MLP_GLOB), ("full", None)):
        model = tiny_model(family)
        compress_model(model, exclude=exclude, embeddings=True, progress=False)
        save_compressed(model, root / f"{name}.zlin")
    model = load_stacked(root / "dense", root / "mlp.pcpool", root / "rest.zlin", "cats", 1.0)
    return family, plain, model, root


def _other_order(family):
    """zstd-linear first (everything but the MLPs), then paired-cache's SparseMLP."""
    model = tiny_model(family)
    compress_model(model, exclude=MLP_GLOB, embeddings=True, progress=False)
    sparsify_model(model, "cats", 1.0)
    return model


def _ids(seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator)  # (1, T)


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits[0]  # (T, vocab)


def test_stacked_model_is_built_from_each_package(stacked):
    _, _, model, _ = stacked
    layers = model.model.layers
    assert all(isinstance(layer.mlp, SparseMLP) for layer in layers)
    assert all(isinstance(layer.self_attn.q_proj, CompressedLinear) for layer in layers)
    assert type(model.get_input_embeddings()).__name__ == "CompressedEmbedding"


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), length=st.integers(1, 24))
def test_lossless_stack_gives_plain_logits_in_either_order(stacked, seed, length):
    family, plain, model, _ = stacked
    ids = _ids(seed, length)
    ref, got = _logits(plain, ids), _logits(model, ids)
    other = _logits(_other_order(family), ids)
    for logits in (got, other):
        assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), length=st.integers(2, 16))
def test_lossless_stack_with_bmrt_kv_gives_plain_tokens(stacked, seed, length):
    _, plain, model, _ = stacked
    ids = _ids(seed, length)
    with torch.inference_mode():
        want = plain.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        with BMRTCache(model, BMRTConfig(budget=64)) as cache:
            got = model.generate(
                ids, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False
            )
    assert torch.equal(got, want)


def _grid_model(family, codec):
    """A tiny model of ``family``; for the grid codec, its MLP weights as a GGUF
    dequantizes them (Q4_1, down_proj Q8_0), which a grid pool stores bit for bit."""
    model = tiny_model(family)
    return on_gguf_grid(model) if codec == "grid" else model


def _compressed_stack_files(family, tmp_path, codec="zstd"):
    """A tiny model of ``family`` saved, its compressed pool (``codec``) and the .zlin of
    the rest (the gates among them), under tmp_path: (the plain model, (model_dir, pool,
    zlin))."""
    files = tmp_path / "dense", tmp_path / "mlp.pcpool", tmp_path / "rest.zlin"
    plain = _grid_model(family, codec)
    plain.save_pretrained(files[0])
    convert(files[0], files[1], compress=codec, progress=False)
    model = _grid_model(family, codec)
    compress_model(model, exclude=list(ROWS_GLOBS), embeddings=True, progress=False)
    save_compressed(model, files[2])
    return plain, files


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("codec", ["zstd", "grid"])
@pytest.mark.parametrize("keep", [None, 1 << 30, "auto"])
def test_compressed_pool_with_compressed_gates_gives_plain_logits(family, keep, codec, tmp_path):
    """Over a zstd or a grid pool, also with the decoded rows kept (a byte count, or
    "auto" sized by room_for_rows from a budget policy's limit with room for everything):
    the same logits, and every row is read from the pool once."""
    plain, files = _compressed_stack_files(family, tmp_path, codec)
    policy = {"policy": "budget", "memory_limit": 1 << 36} if keep == "auto" else {}
    stacked = load_stacked(*files, "cats", 1.0, keep_decoded=keep, **policy)
    layers = stacked.model.layers
    assert all(isinstance(layer.mlp.gate_proj, CompressedLinear) for layer in layers)
    if keep == "auto":
        assert room_for_rows(stacked) >= sum(layer.mlp.decoded_bytes for layer in layers)
    for seed, length in ((0, 1), (1, 9), (2, 17)):
        ids = _ids(seed, length)
        ref, got = _logits(plain, ids), _logits(stacked, ids)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
    packed = [layer.mlp.frames.total_bytes for layer in layers]
    read = [layer.mlp.pool_bytes_read for layer in layers]
    if keep is None:  # each token (one pass of 1, then dense prefills) read every frame
        assert read == [3 * p for p in packed]
    else:
        assert read == packed
        assert all(layer.mlp.kept_rows == layer.mlp.frames.n_rows for layer in layers)


def test_room_for_rows_is_zero_without_room_or_a_budget_policy(tmp_path):
    files = (*_compressed_stack_files("llama", tmp_path)[1], "cats", 0.5)
    assert room_for_rows(load_stacked(*files)) == 0  # per_pass_prefetch: no limit known
    tight = load_stacked(*files, keep_decoded="auto", policy="budget", memory_limit=1 << 20)
    assert room_for_rows(tight) == 0
    assert all(layer.mlp.kept_rows == 0 and layer.mlp._kept is None for layer in tight.model.layers)


def test_kv_budget_follows_what_the_limit_leaves(tmp_path):
    """The floor where nothing is left (no budget policy, a tiny limit), the whole
    sequence where a quarter of what is left holds it, as many tokens as that quarter
    holds in between."""
    files = (*_compressed_stack_files("llama", tmp_path)[1], "cats", 0.5)
    model = load_stacked(*files)
    per_token = kv_bytes_per_token(model.config)
    config = model.config
    heads = config.num_key_value_heads
    assert per_token == config.num_hidden_layers * 2 * heads * config.head_dim * 4
    assert kv_budget(model, 500, 8) == 8  # per_pass_prefetch: no limit known
    tight = load_stacked(*files, policy="budget", memory_limit=1 << 20)
    assert room_left(tight) < 0 and kv_budget(tight, 500, 8) == 8
    ample = load_stacked(*files, policy="budget", memory_limit=1 << 36)
    assert room_left(ample) > 4 * 500 * per_token and kv_budget(ample, 500, 8) == 500
    # 100 tokens' worth left (with the headroom raised by the rest): a quarter, 25 tokens.
    left = room_left(ample, 0)
    assert kv_budget(ample, 500, 8, headroom=left - 100 * per_token) == 25
    assert kv_budget(ample, 500, 30, headroom=left - 100 * per_token) == 30


def test_refused_step_leaves_the_model_unchanged(stacked):
    """A .zlin of the whole model handed to the sparse model (its MLPs are SparseMLPs): refused
    by zstd-linear, naming the SparseMLP and the exclude glob to write instead, before the
    model changes."""
    from paired_cache import load_sparse
    from zstd_linear import load_compressed

    _, _, _, root = stacked
    model = load_sparse(root / "dense", root / "mlp.pcpool", "cats", 1.0, rows="in_place")
    ids = _ids(0, 12)
    before = _logits(model, ids)
    modules = {name: type(m) for name, m in model.named_modules()}
    with pytest.raises(CompressedFileError, match=r"is a SparseMLP.*exclude='\*\.mlp\.\*'"):
        load_compressed(root / "full.zlin", model)
    assert {name: type(m) for name, m in model.named_modules()} == modules
    assert torch.equal(_logits(model, ids), before)
