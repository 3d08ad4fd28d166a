"""moefy's shared expert (a Qwen2-MoE checkpoint) on a tiny random Llama: the neurons are
partitioned between the shared and the routed experts, the checkpoint sums its experts (with
every expert chosen it is the dense model), and the cache runs it exactly."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from membound_testing.moefy import MoefyConfig, build_key, load_dense, moefy
from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model, seal_model

IDS = np.random.default_rng(0).integers(0, 128, 96).tolist()
SHARED = MoefyConfig(
    num_experts=4, top_k=2, shared_size=16, kmeans_iters=2, sequence_length=32, shards=2
)


@pytest.fixture(scope="module")
def shared_moe(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("m") / "moe"
    return moefy(tiny_llama, out, IDS, SHARED, progress=False, seal=seal_model)


def test_a_shared_expert_makes_a_qwen2_moe_that_partitions_the_neurons(shared_moe, tiny_llama):
    cfg = json.loads((shared_moe / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"]) == (4, 2)
    assert (cfg["shared_expert_intermediate_size"], cfg["moe_intermediate_size"]) == (16, 12)
    dense = load_dense(tiny_llama)
    moe, _ = load_model(shared_moe)
    for d, layer in zip(dense.model.layers, moe.model.layers, strict=True):
        rows = {r.tobytes() for r in np.array(d.mlp.gate_proj.weight)}  # 64 neurons
        shared = [r.tobytes() for r in np.array(layer.mlp.shared_expert.gate_proj.weight)]
        stacked = np.array(layer.mlp.switch_mlp.gate_proj.weight)  # (4, 12, 32)
        routed = [r.tobytes() for r in stacked.reshape(-1, 32)]
        assert len(shared) + len(routed) == 64 and set(shared) | set(routed) == rows


def test_the_shared_expert_checkpoint_with_every_expert_is_the_dense_model(shared_moe, tiny_llama):
    """A zero router (softmax exactly 1/4 over the 4 experts) and top-4: the routed experts
    times their weight plus the shared expert (sigmoid(0) = 1/2, down_proj doubled) sum every
    neuron once."""
    dense = load_dense(tiny_llama)
    moe, _ = load_model(shared_moe)
    for layer in moe.model.layers:
        layer.mlp.gate.weight = mx.zeros_like(layer.mlp.gate.weight)
        layer.mlp.top_k = 4
    ids = mx.array(IDS[:40])[None]
    want = np.array(dense(ids)[0])
    got = np.array(moe(ids)[0])
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_exact_mode_equals_stock_on_the_shared_expert_checkpoint(shared_moe):
    stock, _ = load_model(shared_moe)
    want = generate(stock, IDS[:8], 6).tokens
    cached = load_cached_model(shared_moe, ExpertCacheConfig(capacity_share=0.5, mode="exact"))
    assert generate(cached.model, IDS[:8], 6, cached.manager).tokens == want
    assert cached.manager.total_metrics().misses > 0
    ids = mx.array(IDS[:24])[None]
    fresh = load_cached_model(shared_moe, ExpertCacheConfig(capacity_share=0.5, mode="exact"))
    assert float(mx.abs(fresh.model(ids) - stock(ids)).max()) <= 1e-5


@pytest.mark.parametrize("bad", [-1, True, 2.0, "16"])
def test_shared_size_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match="shared_size must be an integer >= 0"):
        MoefyConfig(shared_size=bad)


@pytest.mark.parametrize(
    ("shared", "message"),
    [(64, r"shared_size must be in \[0, intermediate_size=64\)"), (18, "num_experts must divide")],
)
def test_moefy_refuses_a_shared_size_that_does_not_fit_and_leaves_nothing(
    tmp_path, tiny_llama, shared, message
):
    config = MoefyConfig(num_experts=4, top_k=2, shared_size=shared, kmeans_iters=1)
    with pytest.raises(ValueError, match=message):
        moefy(tiny_llama, tmp_path / "m", IDS, config, progress=False, seal=seal_model)
    assert list(tmp_path.iterdir()) == []


def test_the_build_key_ignores_which_transformers_wrote_the_config(tmp_path):
    """A dense copy converted by another transformers release finds the same build; a
    changed model field does not."""
    keys = []
    for name, version, layers in (("a", "5.23.0", 30), ("b", "5.24.0", 30), ("c", "5.24.0", 31)):
        d = tmp_path / name
        d.mkdir()
        config = {"model_type": "llama", "num_hidden_layers": layers}
        (d / "config.json").write_text(json.dumps({**config, "transformers_version": version}))
        (d / "model.safetensors").write_bytes(b"0" * 8)
        keys.append(build_key(d, IDS, SHARED))
    assert keys[0] == keys[1] != keys[2]


def test_calibration_forward_matches_mlx_lm(tiny_llama):
    """moefy's numpy forward (BLAS products, the layer's own MLX norms and RoPE) gives what
    mlx-lm's own layers give: each layer's MLP input and neuron activations, per chunk."""
    import mlx.nn as nn
    from mlx_lm.models.base import create_attention_mask

    from membound_testing.moefy.split import layer_activations

    model = load_dense(tiny_llama)
    chunks = [np.asarray(IDS[:40]), np.asarray(IDS[40:96])]
    hs = [model.model.embed_tokens(mx.array(c)[None]) for c in chunks]
    got = list(layer_activations(model, chunks))
    assert len(got) == len(model.model.layers) == 2
    for layer, (x, act) in zip(model.model.layers, got, strict=True):
        xs, acts = [], []
        for i, h in enumerate(hs):
            h = h + layer.self_attn(layer.input_layernorm(h), create_attention_mask(h), None)
            x_ref = layer.post_attention_layernorm(h)
            a_ref = nn.silu(layer.mlp.gate_proj(x_ref)) * layer.mlp.up_proj(x_ref)
            hs[i] = h + layer.mlp.down_proj(a_ref)
            xs.append(np.array(x_ref[0]))
            acts.append(np.array(a_ref[0]))
        assert x.shape == (96, 32) and act.shape == (96, 64)
        np.testing.assert_allclose(x, np.concatenate(xs), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(act, np.concatenate(acts), atol=1e-4, rtol=1e-4)
