"""decode_block: decoding steps held above the budget and compressed together."""

import pytest
import torch
from conftest import FAMILIES, VOCAB
from hypothesis import given, settings
from hypothesis import strategies as st

from bmrt_kv import BMRTCache, BMRTConfig, BMRTError


def step(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    prompt=st.integers(1, 40),
    steps=st.integers(1, 30),
    block=st.integers(1, 12),
    decode_block=st.integers(1, 12),
    selector=st.sampled_from(["snapkv", "h2o", "keydiff", "lsh"]),
)
def test_held_steps_stay_within_budget_plus_decode_block(
    tiny_models, family, seed, prompt, steps, block, decode_block, selector
):
    """Between steps a layer holds at most B + k - 1 tokens and is compressed to B when a
    k-th step lands above the budget; during a forward it never passes B + block_size."""
    model = tiny_models[family]
    budget, k = 12, min(decode_block, block)
    config = BMRTConfig(
        budget=budget, protection_divisor=4, block_size=block, selector=selector, decode_block=k
    )
    cache = BMRTCache(model, config)
    ids = torch.randint(
        0, VOCAB, (1, prompt + steps), generator=torch.Generator().manual_seed(seed)
    )
    for chunk in ids[:, :prompt].split(block, -1):
        step(model, cache, chunk)
    full = [layer for layer in cache.layers if hasattr(layer, "held_queries")]
    # A block compresses at once; a last chunk of one token is a step, maybe held.
    assert all(layer.stored <= budget + k - 1 for layer in full)
    for t in range(prompt, prompt + steps):
        before = [layer.stored for layer in full]
        step(model, cache, ids[:, t : t + 1])
        for layer, was in zip(full, before, strict=True):
            expected = was + 1 if was + 1 < budget + k else budget
            assert layer.stored == expected
            held = 0 if layer.held_queries is None else layer.held_queries.shape[-2]
            assert held == max(0, layer.stored - budget)
    assert all(layer.peak_tokens <= budget + block for layer in full)


def test_a_compression_scores_with_every_held_steps_queries(llama, monkeypatch):
    """snapkv (stateless) scores the k held steps' queries together; k = 1 scores one."""
    seen = []
    for k in (1, 4):
        cache = BMRTCache(
            llama, budget=12, protection_divisor=4, block_size=8, selector="snapkv", decode_block=k
        )
        layer = cache.layers[0]
        select = layer.selector.select

        def spy(pool, n, shared=False, exclude=None, select=select):
            seen.append(pool.queries.shape[2] // pool.query_groups)
            return select(pool, n, shared=shared, exclude=exclude)

        monkeypatch.setattr(layer.selector, "select", spy)
        ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))
        step(llama, cache, ids[:, :12])  # the budget, full: nothing to compress
        for t in range(12, 20):
            step(llama, cache, ids[:, t : t + 1])
    assert seen == [1] * 8 + [4, 4]


def test_a_block_after_held_steps_compresses_them_first(llama):
    cache = BMRTCache(
        llama, budget=12, protection_divisor=4, block_size=8, selector="snapkv", decode_block=8
    )
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5))
    step(llama, cache, ids[:, :12])
    for t in range(12, 17):
        step(llama, cache, ids[:, t : t + 1])
    assert cache.stored_tokens[0] == 17  # five steps held
    step(llama, cache, ids[:, 17:25])  # a full block: fits only once they are compressed
    assert cache.stored_tokens == [12] * len(cache.layers)
    assert all(layer.peak_tokens <= 12 + 8 for layer in cache.layers)
    assert cache.get_seq_length() == 25


def test_one_step_at_a_time_is_the_default():
    assert BMRTConfig().decode_block == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"decode_block": 0},
        {"decode_block": True},
        {"decode_block": 2.0},
        {"decode_block": 9, "block_size": 8},
        {"decode_block": 33, "budget": 32},  # block_size None: the block in effect is 32
    ],
)
def test_a_bad_decode_block_is_refused_by_name(kwargs):
    base = {"budget": 32, "protection_divisor": 4}
    with pytest.raises(BMRTError, match="decode_block"):
        BMRTConfig(**{**base, **kwargs})
