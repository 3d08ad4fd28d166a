"""The support matrix: every MoE architecture of mlx-lm whose experts the cache pages runs in
exact mode with fewer experts resident than the layer has, and gives stock mlx-lm's tokens
and logits; the other MoE architectures are refused by name before anything is loaded.

Each checkpoint is built offline from mlx-lm's own ``ModelArgs`` / ``Model`` classes with
tiny random weights, and saved by mlx-lm's own ``save_model`` / ``save_config``, so the
directory is what ``mlx_lm.load`` opens. Every parameter that mlx-lm initialises to a
constant (routers' and experts' biases, DeepSeek's zero gate and score correction bias,
GPT-OSS's attention sinks, the norms) is randomised, so a routing or bias mistake changes
the output. ``tools/support_matrix.py`` renders the README table from the records.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from membound_testing.support import record
from moe_expert_cache import ExpertCacheConfig, ExpertCacheError, load_cached_model

PACKAGE = "moe-expert-cache"
PROMISE = "exact = stock mlx-lm"  # float32 and 4-bit: a cell says yes only if both hold
# float32, and 4-bit as mlx_lm.convert -q quantizes (group 32, with the architecture's own
# per-layer settings such as an 8-bit router).
BITS = (None, 4)
PROMPT = [3, 17, 42, 99, 7, 50, 31, 64, 5, 120]
DECODE_STEPS = 12
NUM_EXPERTS, TOP_K, CAPACITY = 8, 2, 3

COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,  # mlx-lm quantizes Qwen3-MoE's and GPT-OSS's routers in groups of 64
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": TOP_K,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
DEEPSEEK = {
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,  # layer 0 is a dense MLP, as in the real models
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "n_routed_experts": NUM_EXPERTS,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_group": 4,  # grouped routing: the top 2 of 4 groups of 2 experts
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
}
# model_type -> the config.json keys besides COMMON (tiny sizes, NUM_EXPERTS experts).
SUPPORTED = {
    "mixtral": {"intermediate_size": 64, "num_local_experts": NUM_EXPERTS},
    "qwen2_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": NUM_EXPERTS,
    },
    "qwen3_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_experts": NUM_EXPERTS,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": 8,
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
    },
    "olmoe": {"intermediate_size": 32, "num_experts": NUM_EXPERTS, "norm_topk_prob": False},
    "gpt_oss": {
        "intermediate_size": 32,
        "num_local_experts": NUM_EXPERTS,
        "head_dim": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phimoe": {
        "intermediate_size": 32,
        "num_local_experts": NUM_EXPERTS,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
    "deepseek_v2": {
        **DEEPSEEK,
        "q_lora_rank": None,
        "topk_method": "group_limited_greedy",
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
    "deepseek_v3": {**DEEPSEEK, "q_lora_rank": 16, "norm_topk_prob": True},
    "deepseek": {
        k: DEEPSEEK[k]
        for k in (
            "num_hidden_layers",
            "first_k_dense_replace",
            "intermediate_size",
            "moe_intermediate_size",
            "n_routed_experts",
            "n_shared_experts",
        )
    },
    "glm4_moe": {
        **DEEPSEEK,
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
        "head_dim": 16,
        "rope_scaling": None,
        "use_qk_norm": True,
        "attention_bias": False,
        "partial_rotary_factor": 0.5,
    },
    "granitemoe": {
        "intermediate_size": 64,  # mlx-lm quantizes its experts' down_proj in groups of 64
        "num_local_experts": NUM_EXPERTS,
        "logits_scaling": 2.0,
        "attention_multiplier": 0.125,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "max_position_embeddings": 4096,
        "attention_bias": False,
    },
    "qwen3_next": {
        "num_hidden_layers": 4,  # three linear-attention layers, then a full-attention one
        "full_attention_interval": 4,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": NUM_EXPERTS,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
}
# A sample of the MoE architectures mlx-lm ships whose block no cached block mirrors.
REFUSED = {
    "dots1": {
        **{k: DEEPSEEK[k] for k in ("first_k_dense_replace", "intermediate_size")},
        **{k: DEEPSEEK[k] for k in ("moe_intermediate_size", "n_routed_experts")},
        **{k: DEEPSEEK[k] for k in ("n_shared_experts", "routed_scaling_factor")},
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
    },
    "ernie4_5_moe": {
        "intermediate_size": 64,
        "max_position_embeddings": 4096,
        "use_bias": False,
        "moe_num_experts": NUM_EXPERTS,
        "moe_intermediate_size": 32,
        "moe_k": TOP_K,
    },
    "minimax": {
        "intermediate_size": 32,
        "num_local_experts": NUM_EXPERTS,
        "shared_intermediate_size": 32,
        "max_position_embeddings": 4096,
        "rotary_dim": 8,
    },
}


def write_checkpoint(directory, model_type: str, overrides: dict, bits=None, seed: int = 0):
    """A random-weights ``model_type`` model saved by mlx-lm as ``directory``: its
    ``config.json``, ``model.safetensors`` and ``model.safetensors.index.json``; quantized
    to ``bits`` by mlx-lm's ``quantize_model`` when given."""
    config = {"model_type": model_type, **COMMON, **overrides}
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    params = {}
    for name, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating) and bool(mx.all(p == p.reshape(-1)[0])):
            p = p + 0.2 * mx.random.normal(p.shape, dtype=p.dtype)
        params[name] = p
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    if bits is not None:
        model, config = quantize_model(model, config, group_size=32, bits=bits)
    save_model(directory, model)
    save_config(dict(config), directory / "config.json")
    return directory


def greedy(model) -> tuple[list[int], list[np.ndarray]]:
    """The prompt, then ``DECODE_STEPS`` greedy tokens: ``(tokens, logits per step)``; the
    logits are float32 (vocab,)."""
    cache = make_prompt_cache(model)
    tokens = list(PROMPT)
    logits = model(mx.array(tokens)[None], cache=cache)[0, -1]
    out = [np.array(logits)]
    for _ in range(DECODE_STEPS):
        tokens.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        out.append(np.array(logits))
    return tokens, out


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("model_type", sorted(SUPPORTED))
def test_exact_mode_equals_stock_mlx_lm(tmp_path, model_type, bits):
    model_dir = write_checkpoint(tmp_path, model_type, SUPPORTED[model_type], bits)
    stock, _ = load_model(model_dir)  # the model mlx_lm.load builds
    stock_tokens, stock_logits = greedy(stock)
    sizes = {**COMMON, **SUPPORTED[model_type]}
    # DeepSeek's and GLM-4.5's first layer is dense, as in the real models.
    moe_layers = list(range(sizes.get("first_k_dense_replace", 0), sizes["num_hidden_layers"]))
    for prefetch in (False, True):
        config = ExpertCacheConfig(capacity=CAPACITY, mode="exact", prefetch=prefetch)
        cached = load_cached_model(model_dir, config)
        tokens, logits = greedy(cached.model)

        assert tokens == stock_tokens
        assert (
            max(float(np.abs(a - b).max()) for a, b in zip(logits, stock_logits, strict=True))
            <= 1e-5
        )
        layers = cached.manager.layers
        assert [int(layer.block_path.split(".")[2]) for layer in layers] == moe_layers
        for layer in layers:
            assert layer.slots.num_experts == NUM_EXPERTS
            for proj in layer.projections.values():
                assert type(proj) is (SwitchLinear if bits is None else QuantizedSwitchLinear)
                assert proj.num_experts == CAPACITY
        total = cached.manager.total_metrics()
        assert total.misses > 0 and total.swaps > 0  # the cache really was too small
        assert (total.prefetched > 0) == prefetch
    record(PACKAGE, model_type, PROMISE)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_other_moe_architectures_are_refused_by_name(tmp_path, monkeypatch, model_type):
    # A relative directory, as a user passes one: the message (the table's cell) names it.
    monkeypatch.chdir(tmp_path)
    model_dir = write_checkpoint(Path(model_type), model_type, REFUSED[model_type])
    load_model(model_dir)  # a checkpoint stock mlx-lm opens
    before = {f.name: os.stat(f).st_mtime_ns for f in model_dir.iterdir()}
    with pytest.raises(ExpertCacheError, match=f"model_type '{model_type}'") as info:
        load_cached_model(model_dir, ExpertCacheConfig(capacity=CAPACITY, mode="exact"))
    assert "no MoE layers this package can page" in str(info.value)
    assert {f.name: os.stat(f).st_mtime_ns for f in model_dir.iterdir()} == before
    record(PACKAGE, model_type, PROMISE, refused=info.value)


# The architectures added with the support matrix -> whether the router normalises its
# top-k scores (to one, or DeepSeek-V3's routed_scaling_factor): only then does skip mode
# rescale the scores that survive a miss.
SKIP_NORMALISES = {
    "gpt_oss": True,
    "phimoe": False,
    "deepseek": False,
    "deepseek_v2": False,
    "deepseek_v3": True,
    "glm4_moe": True,
    "granitemoe": True,
    "qwen3_next": True,
}


@pytest.mark.parametrize("model_type", sorted(SKIP_NORMALISES))
def test_skip_mode_drops_misses_as_the_router_normalises(tmp_path, model_type):
    """The routing itself is the stock routing (the exact-mode test); here a missed expert
    gets score 0 and, where the router normalises, the kept scores are rescaled to the
    full top-k's sum."""
    model_dir = write_checkpoint(tmp_path, model_type, SUPPORTED[model_type])
    stock, _ = load_model(model_dir)
    resident = [0, 2, 3, 5, 6]
    cached = load_cached_model(
        model_dir, ExpertCacheConfig(capacity=len(resident), mode="skip", initial={0: resident})
    )
    path = cached.manager.layers[0].block_path  # model.layers.<i>.<attr>
    i, attr = int(path.split(".")[2]), path.split(".")[3]
    stock_block, block = getattr(stock.layers[i], attr), getattr(cached.model.layers[i], attr)
    x = mx.array(np.random.default_rng(0).normal(size=(12, COMMON["hidden_size"])), mx.float32)

    inds, scores = block.route(x)  # (N, k) each
    stock_switch = getattr(stock_block, type(block).switch_attr)  # every expert
    y = stock_switch(x, inds)  # (N, k, D)
    routed = (y * scores[..., None]).sum(axis=-2)
    besides_routed = stock_block(x[None])[0] - routed  # DeepSeek's shared experts
    keep = np.isin(np.array(inds), resident)
    kept = np.where(keep, np.array(scores), 0.0)
    partial = keep.any(axis=-1) & ~keep.all(axis=-1)  # (N,) tokens that lost some experts
    if SKIP_NORMALISES[model_type]:
        full_sum = np.array(scores).sum(-1, keepdims=True)
        kept_sum = np.where(partial[:, None], kept.sum(-1, keepdims=True), 1.0)
        kept = np.where(partial[:, None], kept * full_sum / kept_sum, kept)
    want = (np.array(y) * kept[..., None]).sum(axis=-2) + np.array(besides_routed)

    got = np.array(block(x[None])[0])
    assert partial.any()  # some token computed without some of its experts
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
