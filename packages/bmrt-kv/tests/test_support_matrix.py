"""bmrt-kv on every family users run: tiny random-weights models of each, built offline.

With a budget of at least the sequence, BMRTCache never compresses, so greedy generation
through it must give the tokens (and the logits) of transformers' own cache for that model:
sliding-window layers of hybrid models (gemma2, gemma3_text) keep transformers' window,
full-attention layers get the bounded cache. Below the sequence, each layer stays within
its limit and the selectors score the queries the model itself attended with (q/k norms,
fused projections, partial rotary and NoPE layers included). Families that cannot work are
refused by name before anything is attached. `tools/support_matrix.py` renders the README
table from the records.
"""

import pytest
import torch
from transformers import AttentionInterface

from bmrt_kv import BMRTCache, BMRTConfig, BMRTError
from bmrt_kv.window import SlidingWindowLayer
from membound_testing.families import DENSE, NON_GATED, tiny_model
from membound_testing.support import record

PACKAGE = "bmrt-kv"
SAME = "budget >= sequence = model's own cache"
BOUNDED = {
    "absolute": "budget < sequence: layers within limits, model's queries",
    "rerotate": "the same with positions='rerotate'",
}
HYBRID = ("gemma2", "gemma3_text")
REFUSED = {"gpt_neox": "q_proj"}  # fused query_key_value: its queries are not read
PROMPT, NEW = 30, 12
GENERATE = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)


def prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def hook_count(model) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs)
        for m in model.modules()
    )


def greedy(model, cache=None, **kwargs):
    if cache is not None:
        kwargs.update(past_key_values=cache, prefill_chunk_size=8)
    ids = prompt()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        return_dict_in_generate=True,
        output_logits=True,
        **GENERATE,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, 1)


# The tiny dense models have 4 query heads on 1 KV head (GQA ratio 4); 4 KV heads give
# ratio 1. The non-gated ones (phi, opt) have no KV-head setting.
CASES = [(f, {}) for f in DENSE] + [(f, {"num_key_value_heads": 4}) for f in DENSE]
CASES += [(f, {}) for f in NON_GATED if f not in REFUSED]


@pytest.mark.parametrize(
    ("family", "overrides"), CASES, ids=[f + ("-gqa1" if o else "") for f, o in CASES]
)
def test_budget_at_least_sequence_equals_the_models_own_cache(family, overrides):
    model = tiny_model(family, **overrides)
    # The reference: generate() with transformers' own cache for this model (a
    # DynamicCache with its sliding-window layers), the whole prompt in one forward.
    tokens, logits = greedy(model)
    config = BMRTConfig(budget=PROMPT + NEW, protection_divisor=4, block_size=8)
    with BMRTCache(model, config) as cache:
        got_tokens, got_logits = greedy(model, cache)
    assert torch.equal(got_tokens, tokens)
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=1e-4)
    # Every full-attention layer held the whole stream; a sliding layer only its window.
    text_config = model.config.get_text_config(decoder=True)
    window = getattr(text_config, "sliding_window", None)
    expected = [
        window - 1 if isinstance(layer, SlidingWindowLayer) else PROMPT + NEW - 1
        for layer in cache.layers
    ]
    assert cache.stored_tokens == expected
    assert any(isinstance(layer, SlidingWindowLayer) for layer in cache.layers) == (
        family in HYBRID
    )
    record(PACKAGE, family, SAME)


def capture_queries(model, family: str) -> dict:
    """Route the model's eager attention through a recorder of the queries it attends with
    (after q/k norms and rotary), by layer index; the last forward's are kept."""
    module = __import__(type(model).__module__, fromlist=["eager_attention_forward"])
    eager, seen = module.eager_attention_forward, {}

    def recorder(attn, query, key, value, attention_mask, **kwargs):
        seen[attn.layer_idx] = query.detach().clone()  # (b, H, T, hd)
        return eager(attn, query, key, value, attention_mask, **kwargs)

    name = f"bmrt_kv_test_{family}"
    AttentionInterface.register(name, recorder)
    model.config._attn_implementation = name
    return seen


@pytest.mark.parametrize("positions", ["absolute", "rerotate"])
@pytest.mark.parametrize("family", DENSE + tuple(f for f in NON_GATED if f not in REFUSED))
def test_budget_below_sequence_bounds_every_layer_and_scores_the_models_queries(family, positions):
    model = tiny_model(family)
    config = BMRTConfig(budget=12, protection_divisor=3, block_size=8, positions=positions)
    if family == "opt" and positions == "rerotate":  # learned positions: nothing to rotate
        hooks = hook_count(model)
        with pytest.raises(BMRTError, match=r"'opt'.*rotary") as info:
            BMRTCache(model, config)
        assert hook_count(model) == hooks
        record(PACKAGE, family, BOUNDED[positions], refused=info.value)
        return
    attended = capture_queries(model, family)
    scored = {}
    with BMRTCache(model, config) as cache:
        finish = cache.finish_layer

        def spy(layer_idx, queries, *n_forward):
            if queries is not None:  # None: below the budget, nothing scored
                scored[layer_idx] = queries.clone()
            finish(layer_idx, queries, *n_forward)

        cache.finish_layer = spy
        with torch.no_grad():
            for block in prompt(2).repeat(1, 2).split(8, -1):  # 60 tokens, 8 a forward
                model(input_ids=block, past_key_values=cache)
                assert all(
                    s <= limit
                    for s, limit in zip(cache.stored_tokens, cache.token_limits, strict=True)
                )
    full = [i for i, layer in enumerate(cache.layers) if not isinstance(layer, SlidingWindowLayer)]
    assert sorted(scored) == full and full
    # OPT scales its queries by head_dim ** -0.5 before attention (and attends with scale
    # 1); the others scale inside attention: the selectors score unscaled queries for all.
    scale = model.config.hidden_size // model.config.num_attention_heads if family == "opt" else 1
    for i in full:
        torch.testing.assert_close(scored[i], attended[i] * scale**0.5, rtol=0, atol=1e-5)
        assert cache.layers[i].stored == 12 and cache.layers[i].seen == 2 * PROMPT
    record(PACKAGE, family, BOUNDED[positions])


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_it_cannot_read_are_refused_by_name_before_attaching(family):
    model = tiny_model(family)
    hooks = hook_count(model)
    with pytest.raises(BMRTError, match=family) as info:
        BMRTCache(model, BMRTConfig(budget=64, protection_divisor=4, block_size=8))
    assert REFUSED[family] in str(info.value)
    assert hook_count(model) == hooks
    record(PACKAGE, family, SAME, refused=info.value)
    for promise in BOUNDED.values():
        record(PACKAGE, family, promise, refused=info.value)


def test_the_matrix_covers_the_traits_named_in_the_issue():
    """Softcapping, q/k norms, hybrid layers and both GQA ratios are really in the models
    the tests above run, so their passing covers them."""
    gemma2 = tiny_model("gemma2").config
    assert gemma2.attn_logit_softcapping and gemma2.final_logit_softcapping
    for family in ("qwen3", "olmo2", "gemma3_text"):
        attention = [m for m in tiny_model(family).modules() if hasattr(m, "q_norm")]
        assert attention and all(hasattr(m, "k_norm") for m in attention)
    for family in HYBRID:
        types = tiny_model(family).config.layer_types
        assert {"sliding_attention", "full_attention"} <= set(types)
    assert tiny_model("phi3", num_key_value_heads=4).config.num_key_value_heads == 4
    assert tiny_model("phi3").config.num_key_value_heads == 1
    assert any(not getattr(m, "use_rope", True) for m in tiny_model("smollm3").modules())


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_below_budget_full_layers_in_budget_sliding_layers_in_window(family):
    model = tiny_model(family)
    window = model.config.sliding_window
    ids = prompt(3)
    # An explicit mask: generate() would read the prompt's pad-id tokens as padding.
    kwargs = dict(attention_mask=torch.ones_like(ids), prefill_chunk_size=8, **GENERATE)
    with BMRTCache(model, BMRTConfig(budget=16, protection_divisor=4, block_size=8)) as cache:
        out = model.generate(ids, past_key_values=cache, **kwargs)
        assert out.shape == (1, PROMPT + NEW)
        kinds = [
            "sliding" if isinstance(layer, SlidingWindowLayer) else "full" for layer in cache.layers
        ]
        assert kinds == [t.split("_")[0] for t in model.config.layer_types]
        sliding = [i for i, kind in enumerate(kinds) if kind == "sliding"]
        full = [i for i, kind in enumerate(kinds) if kind == "full"]
        assert sliding and full
        stored = cache.stored_tokens
        assert [stored[i] for i in full] == [16] * len(full)
        assert [stored[i] for i in sliding] == [window - 1] * len(sliding)
        assert cache.token_limits == [16 if k == "full" else window - 1 for k in kinds]
        # kv_bytes counts both kinds: (1 KV head x 16 dims x K and V x float32) per token.
        per_token = 1 * 16 * 2 * 4
        assert cache.kv_bytes() == sum(stored) * per_token
        # During a block a full layer holds budget + block, a sliding one window - 1 + block.
        peaks = [layer.peak_tokens for layer in cache.layers]
        assert [peaks[i] for i in full] == [16 + 8] * len(full)
        assert [peaks[i] for i in sliding] == [window - 1 + 8] * len(sliding)
        assert cache.peak_kv_bytes() == sum(peaks) * per_token
        # reset() empties both kinds of layer: the same cache then gives the same tokens.
        cache.reset()
        assert cache.stored_tokens == [0] * len(kinds) and cache.get_seq_length() == 0
        assert torch.equal(model.generate(ids, past_key_values=cache, **kwargs), out)
