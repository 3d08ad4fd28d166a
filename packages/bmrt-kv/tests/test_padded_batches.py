"""Padded batches are refused before any layer runs; equal-length rows each get their own
answer.

A padded row would be compressed at the batch's block boundaries and positions, with its
pads among the candidates, so it would not get the tokens it gets alone (on SmolLM2 at
B = 24 it answered another sentence). BMRTCache therefore refuses an attention mask with
zeros, naming what to do instead.
"""

import pytest
import torch
from conftest import VOCAB

from bmrt_kv import BMRTCache, BMRTConfig, BMRTError

CONFIG = BMRTConfig(budget=12, protection_divisor=3, block_size=8)
GENERATE = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)


def rows(n: int, length: int, seed: int) -> torch.Tensor:
    # Token ids from 1: 0 is the pad id, which generate() would read as padding.
    return torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def test_a_left_padded_batch_is_refused_before_any_layer_runs(llama):
    ids = rows(2, 20, 0)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # transformers' batching: row 1 is 5 tokens shorter
    with BMRTCache(llama, CONFIG) as cache:
        with pytest.raises(BMRTError, match=r"padded input: rows \[1\].*one prompt at a time"):
            llama.generate(
                ids, attention_mask=mask, past_key_values=cache, prefill_chunk_size=8, **GENERATE
            )
        # Nothing was cached: the same cache then serves an unpadded prompt as a new one does.
        assert cache.get_seq_length() == 0
        assert not any(layer.is_initialized for layer in cache.layers)
        alone = ids[:1]
        got = llama.generate(alone, past_key_values=cache, prefill_chunk_size=8, **GENERATE)
    with BMRTCache(llama, CONFIG) as fresh:
        expected = llama.generate(alone, past_key_values=fresh, prefill_chunk_size=8, **GENERATE)
    assert torch.equal(got, expected)


def test_a_right_padded_batch_is_refused_at_the_first_chunk_holding_a_pad(llama):
    """generate() hands each prefill chunk the mask up to that chunk, so right padding
    (which transformers itself warns against for decoder-only models) shows only in the
    chunk that holds it: the chunks before it were cached."""
    ids = rows(2, 20, 0)
    mask = torch.ones_like(ids)
    ids[1, -5:], mask[1, -5:] = 0, 0
    with BMRTCache(llama, CONFIG) as cache:
        with pytest.raises(BMRTError, match=r"padded input: rows \[1\]"):
            llama.generate(
                ids, attention_mask=mask, past_key_values=cache, prefill_chunk_size=8, **GENERATE
            )
        assert cache.get_seq_length() == 8  # the first chunk, tokens 0-7, before the pads


def test_equal_length_rows_each_get_what_they_get_alone(llama):
    """Unpadded rows are compressed independently: with B = 12 well below the 30 + 10
    tokens, each row of the batch generates what it generates alone."""
    ids = rows(3, 30, 1)
    with BMRTCache(llama, CONFIG) as cache:
        batch = llama.generate(ids, past_key_values=cache, prefill_chunk_size=8, **GENERATE)
        assert cache.stored_tokens == [12] * len(cache.layers)
    for row in range(ids.shape[0]):
        with BMRTCache(llama, CONFIG) as cache:
            alone = llama.generate(
                ids[row : row + 1], past_key_values=cache, prefill_chunk_size=8, **GENERATE
            )
        assert torch.equal(batch[row : row + 1], alone), row


def test_smollm2_left_padded_batch_is_refused(smollm2):
    """The issue's case: two prompts of different lengths, left-padded by the tokenizer."""
    model, tokenizer = smollm2
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    try:
        tokenizer.padding_side = "left"
        tokenizer.pad_token = pad or tokenizer.eos_token
        prompts = ["What is the capital of France?", "Say hello."]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    assert not bool(batch.attention_mask.all())
    with BMRTCache(model, BMRTConfig(budget=24, protection_divisor=4, block_size=8)) as cache:
        with pytest.raises(BMRTError, match=r"padded input: rows \[1\]"):
            model.generate(
                **batch,
                past_key_values=cache,
                prefill_chunk_size=8,
                max_new_tokens=8,
                do_sample=False,
            )
        assert cache.get_seq_length() == 0
