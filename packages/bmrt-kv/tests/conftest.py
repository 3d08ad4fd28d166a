"""Tiny random models of each supported family (session scope) and the real SmolLM2.

The evaluation code (the pass key, the RULER-style suite, benchmarks/retrieval.py) lives in
benchmarks/, out of the wheel; the tests run from a checkout (the release check too, against
the installed wheel), so they import it from there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

VOCAB = 97
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON, use_sliding_window=False)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16)),
}


def _build(name: str):
    torch.manual_seed(0)
    model = FAMILIES[name]().eval()
    # Random init gives near-uniform attention; larger q/k weights make attention peaky,
    # so eviction changes the outputs and the tests can see it.
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj"):
                module.q_proj.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_models():
    return {name: _build(name) for name in FAMILIES}


@pytest.fixture(scope="session")
def llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def smollm2():
    from membound_testing import load_smollm2

    return load_smollm2()
