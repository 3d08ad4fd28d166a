"""The hooks are scoped to their cache: after it is done, the model is exactly as it was."""

import gc
import inspect
import warnings

import pytest
import torch
import transformers
from conftest import FAMILIES, VOCAB
from packaging import version
from transformers import DynamicCache

import bmrt_kv
from bmrt_kv import BMRTCache, BMRTConfig, BMRTError, BoundedStream
from bmrt_kv.hooks import cache_keyword, call_cache

CONFIG = BMRTConfig(budget=12, protection_divisor=3, block_size=4)


def snapshot(model):
    """Every module's attributes and hooks, by name: what a cache must leave untouched."""
    return {
        name: (
            sorted(vars(module)),
            list(module._forward_hooks),
            list(module._forward_pre_hooks),
            list(module._forward_hooks_with_kwargs),
            list(module._forward_pre_hooks_with_kwargs),
        )
        for name, module in model.named_modules()
    }


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def stream(model, cache, n=20):
    ids = torch.arange(3, 3 + n).view(1, n) % VOCAB
    with torch.no_grad():
        for block in ids.split(4, -1):
            model(input_ids=block, past_key_values=cache)


@pytest.fixture
def model(tiny_models):
    model = tiny_models["llama"]
    # A first forward, so that anything transformers sets lazily is in the baseline.
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2]]))
    bmrt_kv.detach(model)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_attached_block_leaves_the_model_exactly_as_it_was(tiny_models, family):
    model = tiny_models[family]
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2]]))
    before = snapshot(model)
    with bmrt_kv.attached(model, CONFIG) as cache:
        assert hook_count(model) == 3 * model.config.num_hidden_layers + 1  # + positions
        stream(model, cache)
        assert cache.stored_tokens == [12] * model.config.num_hidden_layers
    assert snapshot(model) == before
    assert not any(name.startswith("_bmrt") for m in model.modules() for name in vars(m))


def test_hooks_go_when_the_block_raises(model):
    before = snapshot(model)
    with pytest.raises(BMRTError, match="exceeds"), bmrt_kv.attached(model, CONFIG) as cache:
        model(input_ids=torch.arange(20).view(1, 20), past_key_values=cache)
    assert snapshot(model) == before


def test_cache_as_context_manager_and_detach(model):
    before = snapshot(model)
    with BMRTCache(model, CONFIG) as cache:
        assert cache.attached
    assert not cache.attached and snapshot(model) == before
    cache = BMRTCache(model, CONFIG)
    cache.detach()
    cache.detach()  # idempotent
    assert snapshot(model) == before


def test_a_collected_cache_takes_its_hooks_with_it(model):
    before = snapshot(model)
    ids = torch.arange(3, 23).view(1, 20) % VOCAB
    model.generate(
        ids,
        past_key_values=BMRTCache(model, CONFIG),
        prefill_chunk_size=4,
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
    )
    gc.collect()
    assert snapshot(model) == before


def test_hooks_act_only_for_their_own_cache(model):
    first, second = BMRTCache(model, CONFIG), BMRTCache(model, CONFIG)
    stream(model, first)
    assert first.stored_tokens == [12, 12] and second.stored_tokens == [0, 0]
    # A DynamicCache forward beside an attached cache is the plain model's.
    ids = torch.arange(3, 23).view(1, 20)
    with torch.no_grad():
        plain = model(input_ids=ids, past_key_values=DynamicCache(config=model.config)).logits
    bmrt_kv.detach(model)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    assert torch.equal(plain, reference)
    assert not first.attached and not second.attached


@pytest.mark.parametrize(("budget", "selector"), [(12, "snapkv"), (64, "snapkv"), (64, "h2o")])
def test_queries_are_rotated_only_for_a_layer_that_scores(model, monkeypatch, budget, selector):
    """A stateless selector scores only a layer above its budget: below it the hook hands
    no queries over and rotates none; a stateful one (h2o) scores every forward."""
    import bmrt_kv.hooks as hooks

    rotated = []
    real = hooks.apply_rope
    monkeypatch.setattr(hooks, "apply_rope", lambda q, *a: rotated.append(q.shape) or real(q, *a))
    config = BMRTConfig(budget=budget, protection_divisor=4, block_size=4, selector=selector)
    cache = BMRTCache(model, config)
    stream(model, cache)  # 20 tokens, 4 a forward, over 2 layers
    above = 0 if budget >= 20 and selector == "snapkv" else 5 if selector == "h2o" else 2
    assert len(rotated) == 2 * above
    assert cache.stored_tokens == [min(budget, 20)] * 2
    # At the budget, one more token needs no queries for snapkv, and every forward needs
    # them for h2o, whose finish refuses None before anything changes.
    layer = cache.layers[0]
    assert layer.needs_queries(0) == (selector == "h2o")
    if selector == "h2o":
        seen = layer.seen
        with pytest.raises(RuntimeError, match="queries are needed"):
            layer.finish(None, 0, 1)
        assert layer.seen == seen


def test_beam_search_is_refused(model):
    ids = torch.arange(3, 11).view(1, 8)
    with BMRTCache(model, CONFIG) as cache, pytest.raises(BMRTError, match="beam search"):
        model.generate(ids, past_key_values=cache, num_beams=2, max_new_tokens=4, do_sample=False)


def test_query_aware_without_a_question_is_refused(model):
    config = BMRTConfig(budget=12, protection_divisor=3, block_size=8, scoring="query_aware")
    with pytest.raises(BMRTError, match=r"BoundedStream.*question"):
        BMRTCache(model, config)
    with pytest.raises(BMRTError, match="question"):
        BoundedStream(model, config=config)
    assert hook_count(model) == 0


def test_the_question_flag_is_not_public(model):
    """Only BoundedStream, which passes the question itself, may build a query-aware cache:
    the flag that allows it is no argument of BMRTCache (#56)."""
    assert list(inspect.signature(BMRTCache).parameters) == ["model", "config", "overrides"]
    config = BMRTConfig(budget=12, protection_divisor=3, block_size=8, scoring="query_aware")
    with pytest.raises(BMRTError, match=r"unknown BMRTConfig fields \['_question_supplied'\]"):
        BMRTCache(model, config, _question_supplied=True)
    assert hook_count(model) == 0
    with BoundedStream(model, config=config, question=[5, 6]) as stream:
        assert stream.cache.config.scoring == "query_aware" and stream.cache.attached
    assert hook_count(model) == 0


def test_a_question_with_agnostic_scoring_is_refused(model):
    with pytest.raises(BMRTError, match="agnostic"):
        BoundedStream(model, config=CONFIG, question=[5, 6])


def test_stream_closes_its_hooks(model):
    before = snapshot(model)
    with BoundedStream(model, config=CONFIG) as s:
        s.feed(list(range(3, 23)))
    assert snapshot(model) == before


def test_wrong_prefill_positions_are_corrected(model):
    """transformers 5.2's generate(prefill_chunk_size=...) passed every chunk the position
    ids of the prompt's last chunk; the cache's decoder hook rebuilds them (and only then)."""
    ids = (torch.arange(16).view(1, 16) * 7 + 3) % VOCAB

    def run(cache, wrong: bool):
        logits = []
        with torch.no_grad():
            for start in range(0, 16, 4):
                cache_position = torch.arange(start, start + 4)
                positions = torch.arange(12, 16) if wrong else cache_position
                out = model(
                    input_ids=ids[:, start : start + 4],
                    past_key_values=cache,
                    position_ids=positions.view(1, 4),
                    cache_position=cache_position,
                    attention_mask=torch.ones(1, start + 4, dtype=torch.long),
                )
                logits.append(out.logits)
        return torch.cat(logits, 1)

    with bmrt_kv.attached(model, CONFIG) as cache:
        right = run(cache, wrong=False)
    with (
        bmrt_kv.attached(model, CONFIG) as cache,
        pytest.warns(UserWarning, match="wrong position"),
    ):
        corrected = run(cache, wrong=True)
    torch.testing.assert_close(corrected, right)
    # Without the cache's hook, the same wrong ids change the logits (the test can fail).
    full_right = run(DynamicCache(config=model.config), wrong=False)
    full_wrong = run(DynamicCache(config=model.config), wrong=True)
    assert not torch.allclose(full_wrong, full_right, atol=1e-4)


def test_the_hooks_find_the_cache_under_either_name():
    """transformers 5.24 renamed the cache argument from ``past_key_values`` to ``cache``;
    its decoder layers call attention with ``cache=``, older releases with the old name."""
    cache = object()
    assert call_cache({"cache": cache, "position_embeddings": None}) is cache
    assert call_cache({"past_key_values": cache}) is cache
    assert call_cache({"cache": None, "past_key_values": cache}) is cache
    assert call_cache({}) is None


def test_cache_keyword_is_the_one_forward_takes(model):
    keyword = cache_keyword(model)
    assert keyword in inspect.signature(type(model).forward).parameters
    renamed = version.parse(transformers.__version__) >= version.parse("5.24")
    assert keyword == ("cache" if renamed else "past_key_values")


def test_the_stream_passes_the_cache_without_deprecation_warnings(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with BoundedStream(model, config=CONFIG) as s:
            s.feed(list(range(3, 23)))
            new = s.generate(max_new_tokens=3)
            held = s.cache.stored_tokens
    assert len(new) == 3 and max(held) <= 12
