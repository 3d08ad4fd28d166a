"""diffulex-edge: a real ExecuTorch .pte against the eager model, for random tiny SDAR configs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffulex_edge import EagerDynamic, GenerationConfig, PteEngine, export_pte, generate
from diffulex_edge.backends import Backend
from diffulex_edge.config import tiny_config
from diffulex_edge.export import EXPORT_VARIANTS
from diffulex_edge.remasking import REMASKING

# The test-model builder is not in the wheel: diffulex-edge keeps it in its benchmarks/.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages/diffulex-edge/benchmarks"))
from random_sdar import random_model


class Lockstep(Backend):
    """Drives the eager backend and the .pte backend with the same blocks and keeps each
    denoising step's largest logit difference (the eager logits steer the decoding)."""

    def __init__(self, eager: Backend, pte: Backend) -> None:
        super().__init__()
        self.eager, self.pte, self.diffs = eager, pte, []
        self.block_size, self.max_seq = eager.block_size, pte.max_seq

    def reset(self):
        self.eager.reset()
        self.pte.reset()

    def denoise(self, block_ids):
        a, b = self.eager.denoise(block_ids), self.pte.denoise(block_ids)
        self.diffs.append(float((a - b).abs().max()))
        return a

    def commit(self, block_ids):
        self.eager.commit(block_ids)
        self.pte.commit(block_ids)


@st.composite
def tiny_configs(draw):
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    vocab = draw(st.integers(16, 96))
    return tiny_config(
        vocab_size=vocab,
        hidden_size=draw(st.sampled_from([16, 32, 48])),
        intermediate_size=draw(st.sampled_from([16, 48, 64])),
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=draw(st.sampled_from([10_000.0, 1_000_000.0])),
        mask_token_id=vocab - 1,
        eos_token_id=vocab - 2,
    )


@settings(max_examples=2, deadline=None, derandomize=True)
@given(
    config=tiny_configs(),
    seed=st.integers(0, 2**16),
    block=st.sampled_from([2, 4]),
    variant=st.sampled_from(sorted(EXPORT_VARIANTS)),
    remasking=st.sampled_from(sorted(REMASKING)),
    prompt_len=st.integers(1, 9),
)
def test_pte_and_eager_agree_on_random_tiny_configs(
    tmp_path_factory, config, seed, block, variant, remasking, prompt_len
):
    """Greedy tokens are equal and every denoising step's logits are within diffulex-edge's
    own .pte tolerance (tests/test_pte.py: 1e-4 absolute; XNNPACK's kernels round
    differently from eager torch)."""
    model = random_model(config, seed=seed)
    max_seq = 48
    path = tmp_path_factory.mktemp("pte") / "model.pte"
    export_pte(model, path, max_seq, block, variant)
    engine = PteEngine(path, expected_config=config)
    prompt = torch.randint(
        0, config.vocab_size - 2, (prompt_len,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    gen = GenerationConfig(max_new_tokens=16, remasking=remasking, stop_on_eos=False)
    lock = Lockstep(EagerDynamic(model, block), engine.backend)
    through_lock = generate(lock, prompt, gen, config.mask_token_id, None)
    assert max(lock.diffs) <= 1e-4
    eager = generate(EagerDynamic(model, block), prompt, gen, config.mask_token_id, None)
    pte = engine.generate(prompt, gen)
    assert len(eager.tokens) == 16
    assert pte.tokens == eager.tokens == through_lock.tokens
