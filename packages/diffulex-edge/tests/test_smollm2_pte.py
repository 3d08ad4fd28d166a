"""SmolLM2-135M-Instruct through the edge pipeline: its fp32 .pte (block_kv and static_kv,
XNNPACK, chunked prefill) decodes the Hugging Face model's greedy tokens and answers the
chat question from the CLI."""

import pytest
import torch

from diffulex_edge.backends import StaticBackend
from diffulex_edge.cli import main
from diffulex_edge.generate import GenerationConfig
from diffulex_edge.runtime import PteEngine, method_step
from membound_testing.models import chat_prompt, load_smollm2, smollm2_float_dir

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def hf():
    return load_smollm2()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers' model with its own cache, EOS included (no stop):
    ``generate`` would stop at the chat's end token, and forcing it on changes the logits."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = model(
            torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("variant", ["block_kv", "static_kv"])
def test_pte_greedy_tokens_equal_transformers_over_32(hf, variant, request):
    model, tokenizer = hf
    ids = tokenizer(chat_prompt(tokenizer, QUESTION))["input_ids"]
    want = hf_greedy(model, ids, 32)
    assert tokenizer.decode(want[:7]) == "The capital of France is Paris."
    fixture = {"block_kv": "smollm2_pte", "static_kv": "smollm2_static_pte"}[variant]
    engine = PteEngine(request.getfixturevalue(fixture))
    assert engine.variant == variant
    got = engine.generate(ids, GenerationConfig(max_new_tokens=32, stop_on_eos=False))
    assert got.tokens == want
    assert len(got.tokens) == 32


def test_pte_chunked_prefill_equals_token_by_token(hf, smollm2_pte):
    _, tokenizer = hf
    ids = torch.tensor([tokenizer(chat_prompt(tokenizer, QUESTION))["input_ids"]])
    engine = PteEngine(smollm2_pte)
    single = StaticBackend(engine.layout, "block_kv", method_step(engine.method))
    a, b = engine.backend.prefill_causal(ids), single.prefill_causal(ids)
    n = ids.shape[1]
    assert (a - b).abs().max().item() <= 1e-3  # logits of magnitude ~30
    assert (engine.backend.kv_cache[..., :n, :] - single.kv_cache[..., :n, :]).abs().max() <= 1e-3
    assert a.argmax().item() == b.argmax().item()


def test_cli_generate_answers_the_capital_question(smollm2_pte, capsys):
    code = main(
        [
            "generate",
            "--pte",
            str(smollm2_pte),
            "--tokenizer",
            str(smollm2_float_dir()),
            "--chat",
            "--prompt",
            QUESTION,
            "--max-new-tokens",
            "24",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "Paris" in out
