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
