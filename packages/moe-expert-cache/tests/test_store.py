"""The lazy expert store and bad input."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import mlx.core as mx
import pytest
from conftest import PROMPT
from hypothesis import given, settings
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model
from moe_expert_cache.expert_store import ExpertStore
from moe_expert_cache.safetensors_io import SafetensorsShard


@pytest.mark.parametrize("bits", [None, 4])
def test_read_expert_is_the_stacked_row(model_dir, bits):
    path = model_dir("qwen3_moe", bits)
    store = ExpertStore(path)
    full = {}
    for f in sorted(path.glob("*.safetensors")):
        full.update(mx.load(str(f)))
    block = "model.layers.1.mlp"
    expert = store.read_expert(block, 5)
    for proj, params in expert.items():
        for param, arr in params.items():
            want = full[f"{block}.switch_mlp.{proj}.{param}"][5]
            assert arr.dtype == want.dtype and mx.array_equal(arr, want)
    assert store.bytes_read[block] == store.expert_nbytes(block)


def test_bfloat16_tensors_round_trip(tmp_path):
    a = mx.random.normal((3, 4, 5)).astype(mx.bfloat16)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"t": a})
    shard = SafetensorsShard(tmp_path / "model.safetensors")
    info = shard.tensors["t"]
    assert mx.array_equal(shard.read(info), a)
    assert mx.array_equal(shard.read(info, row=2), a[2])


def test_only_expert_rows_are_read_and_misses_cost_one_expert(model_dir, monkeypatch):
    reads = []
    original = SafetensorsShard.read

    def spy(self, info, row=None, crc32=None):
        reads.append((info.shape, row))
        return original(self, info, row, crc32)

    monkeypatch.setattr(SafetensorsShard, "read", spy)
    cached = load_cached_model(model_dir("mixtral", 4), ExpertCacheConfig(capacity=3))
    # Every read of an (8, ...) expert stack is one row; whole reads are non-expert tensors.
    assert all(row is not None for shape, row in reads if len(shape) == 3 and shape[0] == 8)
    warm = {b: n for b, n in cached.store.bytes_read.items()}
    for layer in cached.manager.layers:
        assert warm[layer.block_path] == 3 * layer.expert_nbytes
    generate(cached.model, PROMPT, 12, cached.manager)
    for layer in cached.manager.layers:
        m = layer.metrics
        assert m.swaps > 0
        assert m.bytes_read == m.swaps * layer.expert_nbytes
        assert cached.store.bytes_read[layer.block_path] - warm[layer.block_path] == m.bytes_read


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"capacity": 1}, "top_k=2"),
        ({"capacity": 9}, "num_experts=8"),
        ({"capacity_share": 0.1}, r"capacity_share=0\.1 gives 1 experts .* top_k=2"),
        ({"capacity": [4]}, "layers"),
    ],
)
def test_bad_capacity(model_dir, given, match):
    with pytest.raises(ValueError, match=match):
        load_cached_model(model_dir("olmoe"), ExpertCacheConfig(**given))


def test_bad_config_values():
    with pytest.raises(ValueError, match="mode"):
        ExpertCacheConfig(mode="fast")
    with pytest.raises(ValueError, match="policy"):
        ExpertCacheConfig(policy="fifo")
    with pytest.raises(ValueError, match="max_layer_updates"):
        ExpertCacheConfig(max_layer_updates=-1)


def test_too_many_pinned_experts(model_dir):
    with pytest.raises(ValueError, match="pinned"):
        load_cached_model(model_dir("olmoe"), ExpertCacheConfig(capacity=4, pinned={0: [0, 1, 2]}))


def test_model_without_moe_layers(tmp_path):
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=1,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=64,
        num_key_value_heads=2,
    )
    model = llama.Model(args)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps({**args.__dict__}))
    with pytest.raises(ValueError, match="no MoE layers"):
        load_cached_model(tmp_path)


def test_missing_shard(model_dir, tmp_path):
    src = model_dir("mixtral")
    for f in src.iterdir():
        if f.name != "model-00002-of-00002.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_cached_model(tmp_path)


def test_truncated_shard(model_dir, tmp_path):
    src = model_dir("mixtral")
    for f in src.iterdir():
        data = f.read_bytes()
        if f.name == "model-00002-of-00002.safetensors":
            data = data[: len(data) - 100]
        (tmp_path / f.name).write_bytes(data)
    with pytest.raises(ValueError, match="truncated"):
        load_cached_model(tmp_path)


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_cached_model(tmp_path / "nope")


def test_non_expert_weights_are_checked(model_dir, tmp_path):
    """A checkpoint lacking a non-expert tensor is refused, not silently left random."""
    src = model_dir("olmoe")
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    del weights["model.norm.weight"]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_cached_model(tmp_path)


def test_warm_start_from_saved_state(model_dir, tmp_path):
    from moe_expert_cache import config_from_state, read_state

    path = model_dir("qwen2_moe")
    cached = load_cached_model(path, ExpertCacheConfig(capacity=4, pinned={1: [7]}))
    tokens = generate(cached.model, PROMPT, 6, cached.manager).tokens
    cached.manager.save_state(tmp_path / "state.json")
    config = config_from_state(ExpertCacheConfig(), read_state(tmp_path / "state.json"))
    warm = load_cached_model(path, config)
    assert warm.manager.state() == cached.manager.state()
    assert 7 in warm.manager.layers[1].slots.pinned
    assert len(tokens) == 6
    text = (tmp_path / "state.json").read_text().replace('"resident": [[', '"resident": [[1, ')
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(ValueError, match="checksum"):
        read_state(tmp_path / "bad.json")


def test_patch_model_checks_everything_before_changing_the_model(model_dir):
    from mlx_lm.models.mixtral import MixtralSparseMoeBlock
    from mlx_lm.utils import load_model

    from moe_expert_cache.loader import patch_model

    path = model_dir("mixtral")
    model, _ = load_model(path)
    bad = ExpertCacheConfig(capacity=4, pinned={1: [0, 1, 2]})  # layer 1 cannot hold these pins
    with pytest.raises(ValueError, match="pinned"):
        patch_model(model, ExpertStore(path), bad)
    assert all(isinstance(layer.block_sparse_moe, MixtralSparseMoeBlock) for layer in model.layers)


@settings(max_examples=50, deadline=None)
@given(share=st.floats(0.01, 1.0), experts=st.integers(2, 64), top_k=st.integers(1, 8))
def test_share_capacity_is_rounded_or_refused(share, experts, top_k):
    config = ExpertCacheConfig(capacity_share=share)
    want = round(share * experts)
    if top_k <= want <= experts:
        assert config.layer_capacities([experts, experts], top_k) == [want, want]
    else:
        with pytest.raises(ValueError, match="capacity"):
            config.layer_capacities([experts], top_k)
