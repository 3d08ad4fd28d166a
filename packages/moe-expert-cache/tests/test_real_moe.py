"""The cache on the real MoEs (SmolLM2-135M MoEfied into 16 experts per layer: the Mixtral,
and the Qwen2-MoE with a shared expert) against the stock mlx-lm model loaded from the same
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer

from membound_testing.moefy import BUILD_RECORD, MoefyConfig, load_dense, moefy
from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model, seal_model

QUESTION = "What is the capital of France?"
NEW_TOKENS = 12


def chat_ids(path) -> list[int]:
    tokenizer = load_tokenizer(path)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )


def teacher_forced(model, prompt: list[int], continuation: list[int], manager=None):
    """float32 (vocab,) logits after the prompt, then after each continuation token."""
    kv = make_prompt_cache(model)
    out = [model(mx.array(prompt)[None], cache=kv)[0, -1]]
    if manager is not None:
        manager.dynamic_cache_update()
    for t in continuation[:-1]:
        out.append(model(mx.array([[t]]), cache=kv)[0, -1])
        if manager is not None:
            manager.dynamic_cache_update()
    return [np.array(o.astype(mx.float32)) for o in out]


@pytest.fixture(scope="module")
def stock(real_moe):
    model, _ = load_model(real_moe)
    prompt = chat_ids(real_moe)
    tokens = generate(model, prompt, NEW_TOKENS).tokens
    return prompt, tokens, teacher_forced(model, prompt, tokens)


def test_the_checkpoint_is_a_mixtral_with_the_dense_models_attention(real_moe):
    cfg = json.loads((real_moe / "config.json").read_text())
    assert cfg["model_type"] == "mixtral"
    assert (cfg["num_local_experts"], cfg["intermediate_size"]) == (16, 96)
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    record = json.loads((real_moe / BUILD_RECORD).read_text())
    # The fitted routers find most of the experts that carry the activation mass.
    assert min(layer["router_recall"] for layer in record["layers"]) > 0.5


def test_all_experts_with_equal_weights_are_the_dense_model(real_moe):
    """The experts partition the dense MLP's neurons, each once: routed to all 16 with equal
    weights (a zero router, so the softmax gives 1/16 each), the MoE is the dense model."""
    record = json.loads((real_moe / BUILD_RECORD).read_text())
    dense = load_dense(Path(record["source"]))
    moe, _ = load_model(real_moe)
    for layer in moe.model.layers:
        block = layer.block_sparse_moe
        block.gate.weight = mx.zeros_like(block.gate.weight)
        down = block.switch_mlp.down_proj
        # The checkpoint's down_proj carries its top-k for a softmax of 1/top-k each.
        down.weight = down.weight * (block.num_experts / block.num_experts_per_tok)
        block.num_experts_per_tok = block.num_experts
    ids = mx.array(chat_ids(real_moe))[None]
    want = np.array(dense(ids)[0].astype(mx.float32))  # (T, vocab)
    got = np.array(moe(ids)[0].astype(mx.float32))
    assert np.abs(got - want).max() <= 1e-3, np.abs(got - want).max()
    assert (got.argmax(axis=-1) == want.argmax(axis=-1)).all()


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_exact_mode_equals_stock_on_the_real_moe(real_moe, stock, share):
    prompt, tokens, stock_logits = stock
    cached = load_cached_model(real_moe, ExpertCacheConfig(capacity_share=share, mode="exact"))
    logits = teacher_forced(cached.model, prompt, tokens, cached.manager)
    assert (
        max(float(np.abs(a - b).max()) for a, b in zip(logits, stock_logits, strict=True)) <= 1e-5
    )
    manager = cached.manager
    expert_bytes = 3 * 96 * 576 * 4  # gate, up, down of 96 neurons, float32
    assert manager.layers[0].expert_nbytes == expert_bytes
    assert manager.resident_expert_bytes() == 30 * round(share * 16) * expert_bytes
    if share < 1.0:
        assert manager.total_metrics().misses > 0  # the cache really was too small
    again = load_cached_model(real_moe, ExpertCacheConfig(capacity_share=share, mode="exact"))
    assert generate(again.model, prompt, NEW_TOKENS, again.manager).tokens == tokens


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_prefetch_keeps_exact_mode_exact_on_the_real_moe(real_moe, stock, share):
    """The next layer's router on the previous layer's output guesses right often enough
    on real routing to serve requests, and the output stays the stock model's."""
    prompt, tokens, stock_logits = stock
    plain = load_cached_model(real_moe, ExpertCacheConfig(capacity_share=share, mode="exact"))
    teacher_forced(plain.model, prompt, tokens, plain.manager)
    cached = load_cached_model(real_moe, ExpertCacheConfig(capacity_share=share, prefetch=True))
    logits = teacher_forced(cached.model, prompt, tokens, cached.manager)
    assert (
        max(float(np.abs(a - b).max()) for a, b in zip(logits, stock_logits, strict=True)) <= 1e-5
    )
    total, without = cached.manager.total_metrics(), plain.manager.total_metrics()
    # Most prefetched experts are asked for (the recall real_traces.py measures offline).
    assert total.prefetch_used > total.prefetched / 2
    assert total.hits > without.hits and total.swaps == without.swaps
    assert cached.manager.state() == plain.manager.state()
    assert cached.manager.resident_expert_bytes() == 30 * round(share * 16) * (3 * 96 * 576 * 4)
    again = load_cached_model(real_moe, ExpertCacheConfig(capacity_share=share, prefetch=True))
    assert generate(again.model, prompt, NEW_TOKENS, again.manager).tokens == tokens


def test_moefy_refuses_bad_settings_and_leaves_nothing(tmp_path, real_moe):
    with pytest.raises(ValueError, match="top_k"):
        MoefyConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="num_experts must divide"):
        moefy(
            json.loads((real_moe / BUILD_RECORD).read_text())["source"],
            tmp_path / "m",
            list(range(64)),
            MoefyConfig(num_experts=7),
            seal=seal_model,
        )
    with pytest.raises(ValueError, match="calibration_ids"):
        moefy(
            json.loads((real_moe / BUILD_RECORD).read_text())["source"],
            tmp_path / "m",
            [1, 2, 3],
            seal=seal_model,
        )
    assert list(tmp_path.iterdir()) == []


def test_the_demo_build_is_a_qwen2_moe_that_answers_right(real_shared_moe):
    """Every token runs the 1,152 neurons of the largest mean mass; 48 of 128 experts of 3
    are routed (1,296 of 1,536 neurons). Asked the demo's question, stock mlx-lm answers
    "The capital of France is Paris." (the 0.10 build with a shared expert of 256 answered
    "a font", the Mixtral top-4 answers symbols)."""
    cfg = json.loads((real_shared_moe / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_moe"
    assert (cfg["num_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]) == (
        128,
        3,
        48,
    )
    assert cfg["shared_expert_intermediate_size"] == 1152
    model, _ = load_model(real_shared_moe)
    tokens = generate(model, chat_ids(real_shared_moe), NEW_TOKENS).tokens
    text = load_tokenizer(real_shared_moe).decode(tokens, skip_special_tokens=True).strip()
    assert text.startswith("The capital of France is Paris"), text


@pytest.mark.parametrize("map_embeddings", [False, True])
def test_exact_mode_equals_stock_on_the_shared_expert_build(real_shared_moe, map_embeddings):
    """Also with the embedding table left in the shard (the demo's MoE is untied)."""
    model, _ = load_model(real_shared_moe)
    prompt = chat_ids(real_shared_moe)
    tokens = generate(model, prompt, NEW_TOKENS).tokens
    stock_logits = teacher_forced(model, prompt, tokens)
    config = ExpertCacheConfig(capacity_share=0.5, mode="exact", map_embeddings=map_embeddings)
    cached = load_cached_model(real_shared_moe, config)
    logits = teacher_forced(cached.model, prompt, tokens, cached.manager)
    assert (
        max(float(np.abs(a - b).max()) for a, b in zip(logits, stock_logits, strict=True)) <= 1e-5
    )
    manager = cached.manager
    expert_bytes = 3 * 3 * 576 * 4  # gate, up, down of 3 neurons, float32
    assert manager.layers[0].expert_nbytes == expert_bytes
    assert manager.resident_expert_bytes() == 30 * 64 * expert_bytes  # half of 128
    assert manager.total_metrics().misses > 0
