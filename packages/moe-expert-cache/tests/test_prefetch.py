"""Speculative prefetch in exact mode: the stock model's output whatever the guess (right,
wrong or random), the same resident experts as without prefetch, and never more than
``capacity`` experts in the resident stacks."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import DECODE_STEPS, PROMPT, decode_logits
from hypothesis import HealthCheck, given, settings
from mlx_lm.utils import load_model

from membound_testing.random_moe import ARCHITECTURES, random_moe_config, write_random_moe
from moe_expert_cache import (
    ExpertCacheConfig,
    ExpertCacheError,
    config_from_state,
    load_cached_model,
    seal_model,
)

CASES = [(arch, bits) for arch in ARCHITECTURES for bits in (None, 4)]
LAYERS, EXPERTS, TOP_K = 4, 8, 2


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """deep(arch, bits) -> (path, tokens, stock logits) of a 4-layer, 8-expert, top-2
    model (three layers prefetch), with the stock model's greedy tokens."""
    made = {}

    def get(arch: str, bits: int | None = None):
        if (arch, bits) not in made:
            path = write_random_moe(
                tmp_path_factory.mktemp(f"deep_{arch}_{bits}"),
                random_moe_config(arch, num_layers=LAYERS, num_experts=EXPERTS, top_k=TOP_K),
                bits=bits,
                seal=seal_model,
            )
            model, _ = load_model(path)
            tokens = list(PROMPT)
            while len(tokens) < len(PROMPT) + DECODE_STEPS:
                tokens.append(int(np.argmax(decode_logits(model, tokens)[-1])))
            made[arch, bits] = (path, tokens, decode_logits(model, tokens))
        return made[arch, bits]

    return get


def max_diff(a, b) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def run(path, tokens, capacity=None, prefetch=True, trace=False):
    cached = load_cached_model(path, ExpertCacheConfig(capacity=capacity, prefetch=prefetch))
    if trace:
        cached.manager.start_trace()
    return cached, decode_logits(cached.model, tokens, cached.manager)


def stacks_at_capacity(cached) -> None:
    """The resident stacks hold exactly ``capacity`` experts' bytes, counted from the arrays
    themselves."""
    for layer in cached.manager.layers:
        nbytes = sum(
            param.nbytes
            for proj in layer.projections.values()
            for param in (
                proj[name] for name in ("weight", "scales", "biases", "bias") if name in proj
            )
        )
        assert nbytes == layer.slots.capacity * layer.expert_nbytes
        assert len(layer.slots.resident()) == layer.slots.capacity


def test_config_refuses_bad_prefetch_values():
    for bad in ("yes", 1, None):
        with pytest.raises(ExpertCacheError, match="prefetch must be True or False"):
            ExpertCacheConfig(prefetch=bad)
    with pytest.raises(ExpertCacheError, match="prefetch=True needs mode='exact'"):
        ExpertCacheConfig(prefetch=True, mode="skip")
    assert ExpertCacheConfig(prefetch=np.bool_(True)).prefetch is True
    assert ExpertCacheConfig().prefetch is False


@pytest.mark.parametrize(("arch", "bits"), CASES)
def test_prefetch_keeps_exact_mode_exact(deep, arch, bits):
    path, tokens, stock_logits = deep(arch, bits)
    plain, plain_logits = run(path, tokens, prefetch=False)
    cached, logits = run(path, tokens)
    assert max_diff(logits, stock_logits) <= 1e-5
    assert max_diff(plain_logits, stock_logits) <= 1e-5
    total, without = cached.manager.total_metrics(), plain.manager.total_metrics()
    assert total.prefetched > 0 and total.prefetch_used > 0  # the guesses ran and some hit
    # The same experts are loaded into the same slots as without prefetch; the requests
    # the prefetch served count as hits.
    assert cached.manager.state() == plain.manager.state()
    assert total.swaps == without.swaps and total.requests == without.requests
    assert total.hits > without.hits
    nbytes = cached.manager.layers[0].expert_nbytes
    assert total.bytes_read == (total.swaps + total.prefetched - total.prefetch_used) * nbytes
    assert cached.manager.metrics()[0].prefetched == 0  # the first layer has nothing to guess
    stacks_at_capacity(cached)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_guess_wrong_still_gives_the_stock_output(deep, arch):
    path, tokens, stock_logits = deep(arch)
    plain, _ = run(path, tokens, prefetch=False, trace=True)
    actual = {i: plain.manager.trace.layer_requests(i) for i in range(LAYERS)}  # (T, k)
    cached = load_cached_model(path, ExpertCacheConfig(capacity_share=0.5, prefetch=True))
    position = dict.fromkeys(range(LAYERS), 0)

    def wrong_guess(index, x):
        """Experts none of the forward's tokens will ask for, the non-resident ones first;
        where fewer are left (a prompt asks for most), resident ones, which are not read."""
        rows = actual[index][position[index] : position[index] + x.shape[1]]
        position[index] += x.shape[1]
        slots = cached.manager.layers[index].slots
        unused = sorted(set(range(EXPERTS)) - set(rows.ravel().tolist()), key=slots.is_resident)
        resident = sorted(slots.resident() - set(unused))
        return np.array([(unused + resident)[:TOP_K]] * len(rows))

    cached.manager.prefetch.guess = wrong_guess
    logits = decode_logits(cached.model, tokens, cached.manager)
    assert max_diff(logits, stock_logits) <= 1e-5
    total, without = cached.manager.total_metrics(), plain.manager.total_metrics()
    assert total.prefetched > 0 and total.prefetch_used == 0  # every guess read, none used
    assert total.hits == without.hits and total.swaps == without.swaps
    assert cached.manager.state() == plain.manager.state()  # a wrong guess evicts nothing
    stacks_at_capacity(cached)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), capacity=st.sampled_from([2, 3, 5]))
def test_any_guess_keeps_capacity_and_the_stock_output(deep, seed, capacity):
    """Random guesses (any experts, repeats included): the staged experts never exceed
    top_k, the stacks hold capacity experts at every layer call, the output is stock's."""
    path, tokens, stock_logits = deep("mixtral", 4)
    plain, _ = run(path, tokens, capacity=capacity, prefetch=False)
    cached = load_cached_model(path, ExpertCacheConfig(capacity=capacity, prefetch=True))
    rng = np.random.default_rng(seed)
    cached.manager.prefetch.guess = lambda index, x: rng.integers(
        0, EXPERTS, (x.shape[0] * x.shape[1], TOP_K)
    )
    staged_sizes = []
    for layer in cached.manager.layers:

        def spy(take=layer.take_prefetched):
            staged = take()
            staged_sizes.append(len(staged))
            stacks_at_capacity(cached)
            return staged

        layer.take_prefetched = spy
    logits = decode_logits(cached.model, tokens, cached.manager)
    assert max_diff(logits, stock_logits) <= 1e-5
    assert max(staged_sizes) <= TOP_K
    assert cached.manager.total_metrics().prefetched > 0
    assert cached.manager.state() == plain.manager.state()
    stacks_at_capacity(cached)


def test_a_warm_start_keeps_prefetch_on(deep):
    path, tokens, stock_logits = deep("qwen3_moe")
    first, _ = run(path, tokens)
    config = config_from_state(ExpertCacheConfig(prefetch=True), first.manager.state())
    assert config.prefetch is True
    warm = load_cached_model(path, config)
    assert max_diff(decode_logits(warm.model, tokens, warm.manager), stock_logits) <= 1e-5
    assert warm.manager.total_metrics().prefetched > 0


def test_a_layer_without_the_pre_moe_norm_is_refused_before_anything_changes(deep):
    from moe_expert_cache.expert_store import ExpertStore
    from moe_expert_cache.loader import patch_model

    path, _, _ = deep("mixtral")
    model, _ = load_model(path)
    del model.layers[2].post_attention_layernorm
    stock_blocks = [layer.block_sparse_moe for layer in model.layers]
    store = ExpertStore(path)
    try:
        with pytest.raises(ExpertCacheError, match="has no post_attention_layernorm"):
            patch_model(model, store, ExpertCacheConfig(prefetch=True))
    finally:
        store.close()
    assert all(
        layer.block_sparse_moe is b for layer, b in zip(model.layers, stock_blocks, strict=True)
    )
    assert all(type(layer).__name__ == "MixtralDecoderLayer" for layer in model.layers)
