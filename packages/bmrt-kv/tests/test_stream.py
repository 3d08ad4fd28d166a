"""The streaming API on the tiny models: blocks, query-aware scoring, generation."""

import pytest
import torch
from conftest import VOCAB

from bmrt_kv import BMRTConfig
from bmrt_kv.stream import BoundedStream


def test_feed_in_blocks_keeps_the_bound(llama):
    config = BMRTConfig(budget=16, protection_divisor=4, block_size=8, selector="snapkv")
    stream = BoundedStream(llama, config=config)
    ids = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(0))
    assert stream.feed(ids) == 120
    assert stream.cache.get_seq_length() == 120
    assert stream.cache.stored_tokens == [16, 16]
    assert max(layer.peak_tokens for layer in stream.cache.layers) == 24
    new = stream.generate(max_new_tokens=5)
    assert len(new) == 5 and stream.cache.get_seq_length() == 124
    stream.feed([1, 2, 3])  # the last generated token enters the stream first
    assert stream.cache.get_seq_length() == 128


def test_stream_matches_model_generate_with_large_budget(llama):
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    reference = llama.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    stream = BoundedStream(llama, config=BMRTConfig(budget=64, protection_divisor=4, block_size=16))
    assert stream.generate(ids[0], max_new_tokens=6) == reference[0, 40:].tolist()


def test_query_aware_scores_with_the_question_and_drops_it(llama):
    question = [5, 6, 7]
    config = BMRTConfig(budget=16, protection_divisor=4, block_size=8, scoring="query_aware")
    stream = BoundedStream(llama, config=config, question=question)
    ids = torch.randint(0, VOCAB, (50,), generator=torch.Generator().manual_seed(2))
    stream.feed(ids)
    assert stream.cache.get_seq_length() == 50
    for layer in stream.cache.layers:
        assert layer.stored == 16 and layer.peak_tokens <= 16 + 8
        assert int(layer.positions.max()) == 49  # the question never entered the cache


def test_query_aware_changes_the_selection(llama):
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(3))
    kept = []
    for scoring, question in (("agnostic", None), ("query_aware", [1, 2, 3, 4])):
        config = BMRTConfig(budget=16, protection_divisor=4, block_size=8, scoring=scoring)
        stream = BoundedStream(llama, config=config, question=question)
        stream.feed(ids)
        kept.append(torch.cat([layer.positions for layer in stream.cache.layers]))
    assert not torch.equal(kept[0], kept[1])


@pytest.mark.parametrize("positions", ["absolute", "rerotate"])
def test_keydiff_stream_anchor_sums_every_key_seen_and_not_the_question(llama, positions):
    """keydiff's "stream" anchor: the layer's running sum is the sum of the unit keys of
    every context token, kept or evicted, as a full cache holds them; the question's
    scoring-only tokens never count. (Layer 0 only: deeper layers' keys depend on the
    attention over the compressed cache, so they differ from a full cache's.)"""
    from transformers import DynamicCache

    ids = torch.randint(0, VOCAB, (1, 50), generator=torch.Generator().manual_seed(7))
    config = BMRTConfig(
        budget=16,
        protection_divisor=4,
        block_size=8,
        scoring="query_aware",
        positions=positions,
        selector_options={"anchor": "stream"},
    )
    stream = BoundedStream(llama, config=config, question=[5, 6, 7])
    stream.feed(ids[0])
    full = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=ids, past_key_values=full)
    layer = stream.cache.layers[0]
    assert layer.stored == 16 and layer.seen == 50
    expected = torch.nn.functional.normalize(full.layers[0].keys.float(), dim=-1).sum(2)
    torch.testing.assert_close(layer.key_sum, expected, rtol=1e-5, atol=1e-5)


def test_hybrid_with_a_stream_anchored_keydiff_stage_keeps_the_sum(llama):
    options = {"primary": "keydiff", "primary_options": {"anchor": "stream"}}
    config = BMRTConfig(
        budget=16, protection_divisor=4, block_size=8, selector="hybrid", selector_options=options
    )
    stream = BoundedStream(llama, config=config)
    stream.feed(torch.arange(40) % VOCAB)
    assert all(layer.key_sum is not None for layer in stream.cache.layers)


def test_keydiff_stream_anchor_changes_the_selection(llama):
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(3))
    kept = []
    for anchor in ("pool", "stream"):
        config = BMRTConfig(
            budget=16, protection_divisor=4, block_size=8, selector_options={"anchor": anchor}
        )
        stream = BoundedStream(llama, config=config)
        stream.feed(ids)
        kept.append(torch.cat([layer.positions for layer in stream.cache.layers]))
        assert all((layer.key_sum is None) == (anchor == "pool") for layer in stream.cache.layers)
    assert not torch.equal(kept[0], kept[1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(scoring="query_aware"), "question"),
        (dict(scoring="query_aware", question=list(range(8))), "block_size"),
    ],
)
def test_bad_stream_arguments(llama, kwargs, match):
    config = BMRTConfig(
        budget=16, protection_divisor=4, block_size=8, scoring=kwargs.pop("scoring")
    )
    with pytest.raises(ValueError, match=match):
        BoundedStream(llama, config=config, **kwargs)


def test_generate_needs_input_and_a_positive_count(llama):
    stream = BoundedStream(llama, config=BMRTConfig(budget=16, protection_divisor=4, block_size=8))
    with pytest.raises(ValueError, match="feed"):
        stream.generate(max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        stream.generate([1, 2], max_new_tokens=0)


@pytest.mark.parametrize("weight", [0.5, 0.9, 1.0])
def test_question_weight_is_the_questions_share_of_the_scoring_weight(llama, weight):
    question = [5, 6, 7]
    config = BMRTConfig(
        budget=16,
        protection_divisor=4,
        block_size=8,
        scoring="query_aware",
        question_weight=weight,
    )
    stream = BoundedStream(llama, config=config, question=question)
    seen = []
    for layer in stream.cache.layers:
        score = layer.selector.score

        def recording(pool, score=score):
            seen.append(pool.query_weights.view(pool.query_groups, -1))
            return score(pool)

        layer.selector.score = recording
    stream.feed(torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(4)))
    assert seen, "no compression step scored anything"
    for weights in seen:
        question_part = weights[:, -len(question) :].sum(-1)
        total = weights.sum(-1)
        torch.testing.assert_close(question_part / total, torch.full_like(total, weight))
        # every question query counts the same, and so does every block query
        assert torch.unique(weights[:, -len(question) :]).numel() == 1
        assert torch.unique(weights[:, : -len(question)]).numel() == 1
