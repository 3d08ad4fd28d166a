"""moe-expert-cache: exact mode against the stock mlx-lm model, for random tiny MoE configs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from membound_testing.random_moe import ARCHITECTURES, random_moe_config, write_random_moe
from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model, seal_model

STEPS = 10


def teacher_forced_logits(model, tokens: list[int], n_prompt: int, manager=None):
    """float32 (vocab,) logits after the prompt and after each later token of ``tokens``;
    the expert cache updates between tokens, as its README's own-loop usage says."""
    kv = make_prompt_cache(model)
    out = [model(mx.array(tokens[:n_prompt])[None], cache=kv)]
    if manager is not None:
        manager.dynamic_cache_update()
    for t in tokens[n_prompt:]:
        out.append(model(mx.array([[t]]), cache=kv))
        if manager is not None:
            manager.dynamic_cache_update()
    return [np.array(logits[0, -1].astype(mx.float32)) for logits in out]


@st.composite
def moe_configs(draw):
    bits = draw(st.sampled_from([None, 4]))
    experts = draw(st.integers(4, 16))
    config = random_moe_config(
        draw(st.sampled_from(ARCHITECTURES)),
        # 4-bit quantisation groups 64 inputs: every matrix dimension a multiple of 64.
        hidden_size=draw(st.sampled_from([64, 128] if bits else [32, 64, 96])),
        num_layers=draw(st.integers(1, 3)),
        num_experts=experts,
        top_k=draw(st.integers(1, min(4, experts - 1))),
        expert_size=draw(st.sampled_from([64, 128] if bits else [32, 64, 96])),
        vocab_size=draw(st.sampled_from([128, 256])),
    )
    top_k = config["num_experts_per_tok"]
    # Resident experts per layer: at least top_k (one token's experts), fewer than all.
    capacity = draw(st.integers(top_k, experts - 1))
    return config, bits, capacity


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    drawn=moe_configs(),
    seed=st.integers(0, 2**16),
    shards=st.integers(1, 3),
    prompt_len=st.integers(1, 12),
)
def test_exact_mode_equals_stock_mlx_lm(tmp_path_factory, drawn, seed, shards, prompt_len):
    """Greedy tokens equal and every step's logits within moe-expert-cache's own bound
    (tests/test_equivalence.py: max |difference| <= 1e-5), with fewer experts resident
    than the model has."""
    config, bits, capacity = drawn
    path = write_random_moe(
        tmp_path_factory.mktemp("moe"), config, bits=bits, shards=shards, seed=seed, seal=seal_model
    )
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config["vocab_size"], prompt_len).tolist()
    stock_model, _ = load_model(path)
    stock = generate(stock_model, prompt, STEPS)
    cached = load_cached_model(path, ExpertCacheConfig(capacity=capacity, mode="exact"))
    try:
        got = generate(cached.model, prompt, STEPS, cached.manager)
        assert got.tokens == stock.tokens
        assert cached.manager.resident_expert_bytes() < cached.manager.all_expert_bytes()
        tokens = prompt + stock.tokens
        reset = load_cached_model(path, ExpertCacheConfig(capacity=capacity, mode="exact"))
        try:
            logits = teacher_forced_logits(reset.model, tokens, prompt_len, reset.manager)
        finally:
            reset.store.close()
    finally:
        cached.store.close()
    want = teacher_forced_logits(stock_model, tokens, prompt_len)
    assert max(float(np.abs(a - b).max()) for a, b in zip(logits, want, strict=True)) <= 1e-5
