"""The pass-key samples of benchmarks/evaluation.py (llama.cpp's protocol)."""

import random

import pytest
from evaluation import first_number, multikey_sample, passkey_sample, passkey_samples


def test_passkey_sample_follows_the_protocol(smollm2):
    _, tokenizer = smollm2
    sample = passkey_sample(tokenizer, 600, key=31415, depth=0.5)
    n_tokens = len(tokenizer(sample.context).input_ids)
    assert 500 <= n_tokens <= 700
    assert "The pass key is 31415. Remember it. 31415 is the pass key." in sample.context
    assert sample.question == "What is the pass key? The pass key is"
    assert sample.answer == "31415"
    with pytest.raises(ValueError, match="depth"):
        passkey_sample(tokenizer, 600, key=1, depth=1.5)


def test_passkey_samples_spread_depths(smollm2):
    _, tokenizer = smollm2
    samples = passkey_samples(tokenizer, 400, 3, seed=0)
    offsets = [s.context.index("The pass key is") / len(s.context) for s in samples]
    assert offsets == sorted(offsets) and offsets[0] < 0.2 and offsets[-1] > 0.8


def test_multikey_sample_asks_for_one_of_several(smollm2):
    _, tokenizer = smollm2
    keys = {"Alice": 11111, "Bob": 22222, "Carol": 33333}
    sample = multikey_sample(tokenizer, 500, keys, "Bob", random.Random(0))
    for name, value in keys.items():
        assert f"The pass key of {name} is {value}." in sample.context
    assert sample.answer == "22222" and "Bob" in sample.question
    with pytest.raises(ValueError, match="ask"):
        multikey_sample(tokenizer, 500, keys, "Zed", random.Random(0))


def test_first_number():
    assert first_number("It is 48213. Remember") == "48213"
    assert first_number("no digits") is None
