"""zstd-linear's compressed Linear layers under bmrt-kv's bounded cache, on SmolLM2-135M.

bmrt-kv hooks each attention's ``q_proj`` to read the queries; with zstd-linear that module
is a CompressedLinear, so these tests also check that the hook sees the decoded output.
"""

from __future__ import annotations

import torch
from conftest import NEW_TOKENS, greedy, random_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from bmrt_kv import SELECTORS, BMRTCache, BMRTConfig, detach
from zstd_linear import POLICIES, compression_stats, reset_stats, set_policy

N_LAYERS = 30
VOCAB = 49152
# Every selector but magicpig, whose sampling costs seconds per layer and block: too slow
# for every block of a 100-token prompt in two models within the suite's time.
FAST_SELECTORS = sorted(set(SELECTORS) - {"magicpig"})


def use_policy(model, policy: str) -> None:
    set_policy(model, policy, **({"budget_bytes": 64 << 20} if policy == "budget" else {}))
    reset_stats(model)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 2**16),
    length=st.integers(8, 40),
    block=st.integers(8, 48),
    slack=st.integers(0, 16),
    divisor=st.integers(3, 8),
    selector=st.sampled_from(sorted(SELECTORS)),
)
def test_budget_at_least_the_sequence_equals_the_plain_model(
    smollm2, smollm2_zstd, policy, seed, length, block, slack, divisor, selector
):
    """B >= T: greedy tokens and every step's logits are bit-identical (torch.equal) to
    the plain model with a DynamicCache under the same prefill chunks.

    Both packages are exact here: zstd-linear is lossless, and a bmrt-kv cache that never
    evicts returns the same keys and values as a DynamicCache. Chunking the prefill
    itself moves float32 logits by ~3e-5 in transformers (DynamicCache alone), so the
    reference uses the same chunks.
    """
    plain, _ = smollm2
    ids = random_ids(seed, length, VOCAB)
    ref_sequences, ref_logits = greedy(
        plain, ids, past_key_values=DynamicCache(config=plain.config), prefill_chunk_size=block
    )
    use_policy(smollm2_zstd, policy)
    config = BMRTConfig(
        budget=length + NEW_TOKENS + slack,
        protection_divisor=divisor,
        block_size=block,
        selector=selector,
    )
    cache = BMRTCache(smollm2_zstd, config)
    try:
        sequences, logits = greedy(
            smollm2_zstd, ids, past_key_values=cache, prefill_chunk_size=block
        )
    finally:
        detach(smollm2_zstd)
    assert torch.equal(sequences, ref_sequences)
    assert torch.equal(logits, ref_logits)
    # Nothing was evicted (the last generated token is never fed back) ...
    assert cache.stored_tokens == [length + NEW_TOKENS - 1] * N_LAYERS
    # ... and the compressed layers really ran: one pass per prefill chunk and decode step.
    stats = compression_stats(smollm2_zstd)
    assert stats.forward_passes == -(-length // block) + NEW_TOKENS - 1
    assert stats.decompressions > 0


@settings(max_examples=3, deadline=None, derandomize=True)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    budget=st.integers(12, 48),
    block=st.integers(32, 64),
    divisor=st.integers(3, 6),
    selector=st.sampled_from(FAST_SELECTORS),
    positions=st.sampled_from(["absolute", "rerotate"]),
    decode_block=st.integers(1, 8),
)
def test_budget_holds_while_compressed_layers_run(
    smollm2, smollm2_zstd, policy, budget, block, divisor, selector, positions, decode_block
):
    """A ~100-token pass-key prompt through budgets far below its length: no layer ever
    holds more than B + block_size tokens (B after each block, up to B + decode_block - 1
    after decoding steps), and the compressed model
    evicts exactly as the plain model does (bit-identical tokens and logits, since
    zstd-linear is lossless and the selection sees the same queries and keys)."""
    from membound_testing import passkey_prompt

    plain, tokenizer = smollm2
    ids = tokenizer(passkey_prompt(tokenizer, 100, key=7093, depth=0.4), return_tensors="pt")
    ids = ids.input_ids
    assert ids.shape[1] > budget + block  # the bound really binds
    config = BMRTConfig(
        budget=budget,
        protection_divisor=divisor,
        block_size=block,
        selector=selector,
        positions=positions,
        decode_block=decode_block,
    )
    runs = {}
    use_policy(smollm2_zstd, policy)
    for name, model in (("plain", plain), ("zstd", smollm2_zstd)):
        cache = BMRTCache(model, config)
        try:
            runs[name] = (
                *greedy(model, ids, past_key_values=cache, prefill_chunk_size=block),
                cache,
            )
        finally:
            detach(model)
    sequences, logits, cache = runs["zstd"]
    assert max(layer.peak_tokens for layer in cache.layers) <= budget + block
    # B after each block; decoding steps may wait above it, up to decode_block - 1.
    assert all(budget <= s < budget + decode_block for s in cache.stored_tokens)
    per_token = 2 * 3 * 64 * 4  # K + V, 3 KV heads x 64 dims, float32
    assert cache.peak_kv_bytes() <= N_LAYERS * (budget + block) * per_token
    assert compression_stats(smollm2_zstd).decompressions > 0
    assert torch.equal(sequences, runs["plain"][0])
    assert torch.equal(logits, runs["plain"][1])
