"""The embedded SmolLM2-135M with every (untied) Linear compressed."""

from __future__ import annotations

import pytest
import torch
from conftest import NEW_TOKENS, generate

from zstd_linear import POLICIES, compression_stats, reset_stats, set_policy

N_LINEAR = 30 * 7  # q, k, v, o, gate, up, down per layer


def test_every_linear_but_the_tied_lm_head_is_compressed(smollm2_compressed):
    model, _, report = smollm2_compressed
    assert len(report.layers) == N_LINEAR
    assert report.skipped == {"lm_head": "weight tied to model.embed_tokens.weight"}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report.ratio > 1.0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_tokens_and_logits_are_identical(smollm2_compressed, smollm2_reference, policy):
    model, ids, _ = smollm2_compressed
    set_policy(model, policy, **({"budget_bytes": 64 << 20} if policy == "budget" else {}))
    reset_stats(model)
    sequences, logits = generate(model, ids)
    ref_sequences, ref_logits = smollm2_reference
    assert torch.equal(sequences, ref_sequences)
    assert torch.equal(logits, ref_logits)
    stats = compression_stats(model)
    assert stats.forward_passes == NEW_TOKENS
    if policy == "per_pass":
        assert stats.decompressions == NEW_TOKENS * N_LINEAR
        assert stats.decompressions_per_pass == N_LINEAR
    if policy == "per_pass_prefetch":
        slab = 1536 * 576 * 4
        assert stats.peak_decoded_bytes <= 3 * slab
        assert N_LINEAR * NEW_TOKENS <= stats.decompressions <= N_LINEAR * NEW_TOKENS + 2
