"""The cache inside real transformers forwards of each supported family."""

import pytest
import torch
from conftest import FAMILIES, VOCAB
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from bmrt_kv import SELECTORS, BMRTCache, BMRTConfig
from bmrt_kv.rope import rerotate


def feed(model, cache, ids, block):
    with torch.no_grad():
        return torch.cat(
            [model(input_ids=c, past_key_values=cache).logits for c in ids.split(block, -1)], 1
        )


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    length=st.integers(1, 48),
    block=st.integers(1, 16),
    slack=st.integers(0, 20),
    selector=st.sampled_from(sorted(SELECTORS)),
    positions=st.sampled_from(["absolute", "rerotate"]),
    granularity=st.sampled_from(["head", "layer"]),
    decode_block=st.integers(1, 16),
)
def test_budget_at_least_length_equals_full_cache(
    tiny_models, family, seed, length, block, slack, selector, positions, granularity, decode_block
):
    model = tiny_models[family]
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    config = BMRTConfig(
        budget=max(length, 9) + slack,
        protection_divisor=3,
        block_size=block,
        selector=selector,
        positions=positions,
        granularity=granularity,
        decode_block=min(decode_block, block),
    )
    got = feed(model, BMRTCache(model, config), ids, block)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_with_a_large_budget_matches_dynamic_cache(tiny_models, family):
    """Chunked-prefill generate through a cache that never compresses gives the tokens of
    unchunked generate over transformers' DynamicCache. (On transformers 5.2, chunked
    generate over a DynamicCache itself differs: it passes wrong position ids to every
    chunk but the last, which a BMRTCache corrects.)"""
    model = tiny_models[family]
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kwargs)
    cache = BMRTCache(model, BMRTConfig(budget=64, protection_divisor=4, block_size=8))
    got = model.generate(ids, past_key_values=cache, prefill_chunk_size=8, **kwargs)
    assert torch.equal(got, reference)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_compresses_while_decoding(tiny_models, family):
    model = tiny_models[family]
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    config = BMRTConfig(budget=16, protection_divisor=4, block_size=8, selector="lsh")
    cache = BMRTCache(model, config)
    out = model.generate(
        ids,
        past_key_values=cache,
        prefill_chunk_size=8,
        max_new_tokens=20,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert out.shape[-1] == 60
    assert cache.get_seq_length() == 59  # the last generated token is never fed back
    assert cache.stored_tokens == [16] * len(cache.layers)
    assert all(layer.peak_tokens <= 16 + 8 for layer in cache.layers)


def test_compression_changes_the_outputs(llama):
    # Guards the equality tests above: with eviction the logits must differ.
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = llama(input_ids=ids).logits
    got = feed(llama, BMRTCache(llama, budget=12, protection_divisor=4, block_size=8), ids, 8)
    assert (got[0, -1] - reference[0, -1]).abs().max() > 1e-3


def layer0_full_keys(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    return cache.layers[0].keys  # (1, h, T, hd)


def fed_then_stepped(model, ids, block, steps, decode_block, **config) -> BMRTCache:
    """A B=15 cache over ``ids``: all but the last ``steps`` tokens fed in blocks of
    ``block``, then those one at a time as decoding steps (some held, decode_block > 1)."""
    cache = BMRTCache(
        model,
        budget=15,
        protection_divisor=5,
        block_size=max(block, decode_block),
        decode_block=decode_block,
        **config,
    )
    length = ids.shape[-1]
    feed(model, cache, ids[:, : length - steps], block)
    if steps:
        feed(model, cache, ids[:, length - steps :], 1)
    return cache


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    length=st.integers(20, 80),
    block=st.integers(1, 12),
    steps=st.integers(0, 9),
    decode_block=st.integers(1, 6),
)
def test_kept_tokens_keep_their_original_positions(llama, seed, length, block, steps, decode_block):
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    cache = fed_then_stepped(llama, ids, block, steps, decode_block, selector="exact")
    layer = cache.layers[0]
    full = layer0_full_keys(llama, ids)
    # Layer 0's keys depend only on the token and its position, so a kept key equals the
    # full cache's key at the recorded position exactly when the position is original.
    expected = full.gather(2, layer.positions.unsqueeze(-1).expand_as(layer.keys))
    torch.testing.assert_close(layer.keys, expected, rtol=0, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    length=st.integers(20, 80),
    block=st.integers(1, 12),
    steps=st.integers(0, 9),
    decode_block=st.integers(1, 6),
)
def test_rerotate_places_kept_keys_just_before_the_next_query(
    llama, seed, length, block, steps, decode_block
):
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    cache = fed_then_stepped(llama, ids, block, steps, decode_block, positions="rerotate")
    layer = cache.layers[0]
    full = layer0_full_keys(llama, ids)
    original = full.gather(2, layer.positions.unsqueeze(-1).expand_as(layer.keys))
    held = layer.stored  # 15, or up to 15 + decode_block - 1 after held steps
    slots = torch.arange(held) + (length - held)
    expected = rerotate(original, slots - layer.positions, cache.layers[0].inv_freq)
    torch.testing.assert_close(layer.keys, expected, rtol=1e-4, atol=1e-4)


def test_rerotate_streams_past_max_position_embeddings():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config).eval()
    cache = BMRTCache(model, budget=24, protection_divisor=4, block_size=8, positions="rerotate")
    ids = torch.randint(0, VOCAB, (1, 200), generator=torch.Generator().manual_seed(0))
    logits = feed(model, cache, ids, 8)
    assert torch.isfinite(logits).all()
    assert cache.get_seq_length() == 200 and cache.stored_tokens == [24]


def test_a_block_past_the_bound_is_refused_and_the_cache_is_unchanged(llama):
    cache = BMRTCache(llama, budget=16, protection_divisor=4, block_size=8)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(4))
    feed(llama, cache, ids, 8)
    before = [(layer.keys.clone(), layer.positions.clone(), layer.seen) for layer in cache.layers]
    with pytest.raises(ValueError, match="block_size=8"):
        feed(llama, cache, ids[:, :9], 9)
    for layer, (keys, positions, seen) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.positions, positions)
        assert layer.seen == seen


def test_same_seed_same_selection(llama):
    ids = torch.randint(0, VOCAB, (1, 60), generator=torch.Generator().manual_seed(5))
    kept = []
    for seed in (11, 11, 12):
        cache = BMRTCache(
            llama,
            budget=16,
            protection_divisor=4,
            block_size=8,
            selector="lsh",
            selector_options={"tables": 2, "bits": 3},
            seed=seed,
        )
        feed(llama, cache, ids, 8)
        kept.append(torch.cat([layer.positions for layer in cache.layers]))
    assert torch.equal(kept[0], kept[1])
    assert not torch.equal(kept[0], kept[2])


def test_layer_granularity_shares_one_index_per_layer(llama):
    ids = torch.randint(0, VOCAB, (1, 50), generator=torch.Generator().manual_seed(6))
    cache = BMRTCache(llama, budget=16, protection_divisor=4, block_size=8, granularity="layer")
    feed(llama, cache, ids, 8)
    for layer in cache.layers:
        assert torch.equal(layer.positions[:, 0], layer.positions[:, 1])


def test_heads_select_independently(llama):
    ids = torch.randint(0, VOCAB, (1, 50), generator=torch.Generator().manual_seed(6))
    cache = BMRTCache(llama, budget=16, protection_divisor=4, block_size=8)
    feed(llama, cache, ids, 8)
    assert any(
        not torch.equal(layer.positions[:, 0], layer.positions[:, 1]) for layer in cache.layers
    )


def test_the_model_still_works_with_dynamic_cache_after_attaching(llama):
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = llama(input_ids=ids).logits
        BMRTCache(llama, budget=8, protection_divisor=3, block_size=4)
        after = llama(input_ids=ids, past_key_values=DynamicCache(config=llama.config)).logits
    assert torch.equal(before, after)


def test_sliding_window_models_keep_transformers_window():
    """A model whose every layer has a sliding window (Mistral with sliding_window set) is
    cached as transformers caches it: each layer keeps its window, nothing is compressed."""
    from transformers import MistralConfig, MistralForCausalLM

    from bmrt_kv.window import SlidingWindowLayer

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=16,
    )
    model = MistralForCausalLM(config).eval()
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    reference = feed(model, DynamicCache(config=config), ids, 8)
    with BMRTCache(model, budget=12, protection_divisor=3, block_size=8) as cache:
        got = feed(model, cache, ids, 8)
    assert all(isinstance(layer, SlidingWindowLayer) for layer in cache.layers)
    assert cache.stored_tokens == [15, 15] and cache.token_limits == [15, 15]
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)
