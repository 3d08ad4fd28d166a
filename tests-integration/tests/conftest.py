"""Session fixtures: SmolLM2-135M plain, with zstd-linear, and with zstd-linear + SparseMLP.

Every instance is loaded once per session. Linear weights (and so the tied embedding /
lm_head) are moved to freshly allocated memory in every instance, as zstd-linear's own
tests do: the loader leaves them at unaligned offsets of the memory-mapped file, the CPU
GEMM's rounding depends on a weight's address mod 64, and decoded weights always sit at
aligned addresses. Without this, bit-exact comparisons would see the allocator, not the
packages.
"""

from __future__ import annotations

import pytest
import torch

NEW_TOKENS = 6


def load_aligned():
    from membound_testing import align_linear_weights, load_smollm2

    model, tokenizer = load_smollm2()
    align_linear_weights(model)
    return model, tokenizer


def load_aligned_compressed(policy: str = "per_pass_prefetch"):
    """SmolLM2 with every untied Linear loaded from the cached .zlin file."""
    from membound_integration.smollm2_zlin import compressed_smollm2_path
    from zstd_linear import load_compressed

    path = compressed_smollm2_path()
    model, _ = load_aligned()
    load_compressed(path, model, policy)
    return model


def greedy(model, ids: torch.Tensor, **kwargs):
    """Greedy NEW_TOKENS tokens after ids (1, T); returns (sequences, logits (n, vocab))."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    return out.sequences, torch.cat(out.logits)


def random_ids(seed: int, length: int, vocab: int) -> torch.Tensor:
    """(1, length) int64 token ids drawn from a seeded generator."""
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): the plain float32 model, the reference of every comparison."""
    return load_aligned()


@pytest.fixture(scope="session")
def smollm2_zstd():
    """SmolLM2 with all 210 untied Linear layers zstd-compressed (from the cached .zlin)."""
    return load_aligned_compressed()
