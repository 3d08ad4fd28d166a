"""Shared fixtures: small random gated-MLP weights and the embedded SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch


def make_weights(n: int, hidden: int, dtype=torch.float32, seed: int = 0, gate_cols=None):
    """Distinct random (gate (N, g), up (N, hidden), down (hidden, N)) weights."""
    gen = torch.Generator().manual_seed(seed)
    g = hidden if gate_cols is None else gate_cols
    gate = torch.randn(n, g, generator=gen).to(dtype)
    up = torch.randn(n, hidden, generator=gen).to(dtype)
    down = torch.randn(hidden, n, generator=gen).to(dtype)
    return gate, up, down


@pytest.fixture(scope="session")
def smollm2():
    from membound_testing import load_smollm2

    model, tokenizer = load_smollm2()
    return model, tokenizer


def make_tiny_llama(seed: int = 0):
    """A 2-layer random LlamaForCausalLM (float32, gated MLPs of 64 rows): fast real model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()
