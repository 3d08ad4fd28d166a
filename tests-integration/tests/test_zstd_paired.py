"""paired-cache's SparseMLP with a full mask inside a zstd-linear compressed SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch
from conftest import load_aligned, load_aligned_compressed, random_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from paired_cache import SparseMLP, sparsify_model
from zstd_linear import POLICIES, compression_stats, reset_stats, set_policy
from zstd_linear.model import compressed_layers

VOCAB = 49152


@pytest.fixture(scope="session")
def sparse_only():
    """SmolLM2 (plain Linear layers) with every MLP a full-mask SparseMLP."""
    model, _ = load_aligned()
    sparsify_model(model, "oracle", 1.0)
    return model


@pytest.fixture(scope="session")
def zstd_sparse():
    """SmolLM2 loaded compressed, then every MLP a full-mask SparseMLP: sparsify_model reads
    each gate / up / down weight from its CompressedLinear (a full decode), and the
    attention projections stay compressed."""
    model = load_aligned_compressed()
    mlps = sparsify_model(model, "oracle", 1.0)
    assert len(mlps) == 30 and all(isinstance(m, SparseMLP) for m in mlps)
    return model, mlps


def logits_of(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits[0]  # (T, vocab)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 2**16),
    length=st.integers(2, 20),
)
def test_full_mask_sparse_mlp_in_a_compressed_model(
    smollm2, sparse_only, zstd_sparse, policy, seed, length
):
    """Logits are bit-identical (torch.equal) to the same SparseMLPs over plain Linear
    layers: zstd-linear is lossless and the SparseMLP pools hold the decoded weights bit
    for bit. Against the dense model they meet paired-cache's own float32 bound for a full
    mask (tests/test_sparse_mlp.py: max |difference| <= 1e-5 x max |logit|, same argmax;
    the packed (m, hidden) GEMMs round differently from the dense layout, which float64
    shows to be rounding only)."""
    dense, _ = smollm2
    model, mlps = zstd_sparse
    ids = random_ids(seed, length, VOCAB)
    set_policy(model, policy, **({"budget_bytes": 64 << 20} if policy == "budget" else {}))
    reset_stats(model)
    got = logits_of(model, ids)
    assert all(m.cache.num_active == 1536 for m in mlps)  # every row active
    assert torch.equal(got, logits_of(sparse_only, ids))
    want = logits_of(dense, ids)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The attention projections ran compressed: q, k, v, o of 30 layers, each decoded once
    # in the pass (the prefetcher may run up to two layers ahead).
    attention = [n for n in compressed_layers(model) if ".self_attn." in n]
    assert len(attention) == 120
    stats = compression_stats(model)
    assert stats.forward_passes == 1
    assert 120 <= stats.decompressions <= 122
