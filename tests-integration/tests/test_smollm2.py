"""The embedded real model loads offline, decodes deterministically and answers."""

import pytest
import torch

from membound_testing import chat_prompt, load_smollm2, smollm2_gguf_path


@pytest.fixture(scope="session")
def smollm2():
    return load_smollm2()


def _greedy(model, tokenizer, question, n=20):
    ids = tokenizer(chat_prompt(tokenizer, question), return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.input_ids.shape[1] :]


def test_gguf_ships_with_the_package():
    path = smollm2_gguf_path()
    assert path.suffix == ".gguf"
    assert path.stat().st_size > 50 * 2**20


def test_greedy_generation_is_deterministic_and_answers(smollm2):
    model, tokenizer = smollm2
    first = _greedy(model, tokenizer, "What is the capital of France?")
    second = _greedy(model, tokenizer, "What is the capital of France?")
    assert torch.equal(first, second)
    assert "Paris" in tokenizer.decode(first, skip_special_tokens=True)


def test_float_copy_matches_the_gguf_dequantisation(smollm2):
    """The cached safetensors copy holds exactly the weights transformers dequantises."""
    from transformers import AutoModelForCausalLM

    model, _ = smollm2
    gguf = smollm2_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cached = model.state_dict()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(tensor, cached[name]), name
