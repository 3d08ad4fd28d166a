"""Shared fixtures: the embedded SmolLM2-135M, compressed once per session, and a toy
model with repeated short names."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zstd_linear import compress_model, set_policy

QUESTION = "What is the capital of France?"
NEW_TOKENS = 8


class Block(nn.Module):
    """Every block has the same short names, as in a transformer."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=True, dtype=dtype)
        self.up_proj = nn.Linear(dim, 2 * dim, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False, dtype=dtype)

    def forward(self, x):
        x = x + self.q_proj(x)
        return x + self.down_proj(torch.relu(self.up_proj(x)))


class Toy(nn.Module):
    def __init__(self, n_blocks: int = 3, dim: int = 32, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, dtype) for _ in range(n_blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def tiny_llama(seed: int = 0, vocab_size: int = 96):
    """A 2-layer random Llama with a tied lm_head (a transformers model, like SmolLM2);
    ``vocab_size=49152`` makes SmolLM2's tokenizer fit it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def make_toy(seed: int = 0, **kw) -> Toy:
    torch.manual_seed(seed)
    return Toy(**kw).eval()


@pytest.fixture(scope="session")
def smollm2():
    from membound_testing import align_linear_weights, chat_prompt, load_smollm2

    model, tokenizer = load_smollm2()
    align_linear_weights(model)
    ids = tokenizer(chat_prompt(tokenizer, QUESTION), return_tensors="pt")
    return model, tokenizer, ids


def generate(model, ids):
    """Greedy NEW_TOKENS tokens; returns (sequences, logits (NEW_TOKENS, vocab))."""
    with torch.inference_mode():
        out = model.generate(
            **ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences, torch.cat(out.logits)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2):
    model, _, ids = smollm2
    return generate(model, ids)


@pytest.fixture(scope="session")
def smollm2_compressed(smollm2, smollm2_reference):
    """The same SmolLM2 object with every untied Linear compressed (default codec)."""
    model, _, ids = smollm2
    report = compress_model(model)
    yield model, ids, report
    set_policy(model, "per_pass_prefetch")
