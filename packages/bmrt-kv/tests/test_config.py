from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bmrt_kv import SELECTORS, TIE_BREAKERS, BMRTCache, BMRTConfig, BMRTError
from bmrt_kv.config import MAX_SEED


def test_defaults_split_the_budget():
    config = BMRTConfig(budget=1024, protection_divisor=8)
    assert (config.n_anchor, config.n_window, config.n_memory) == (128, 128, 768)


@settings(max_examples=40, deadline=None)
@given(divisor=st.integers(-5, 2))
def test_divisor_below_three_is_rejected(divisor):
    with pytest.raises(ValueError, match="protection_divisor"):
        BMRTConfig(budget=64, protection_divisor=divisor)


@pytest.mark.parametrize(
    ("kwargs", "block"),
    [
        ({}, 512),
        ({"budget": 256}, 256),
        ({"budget": 511}, 511),
        ({"budget": 4096}, 512),
        ({"budget": 256, "block_size": 512}, 512),
        ({"budget": 4096, "block_size": 64}, 64),
        ({"budget": 300, "block_size": None}, 300),
        ({"budget": 256, "scoring": "query_aware"}, 512),
        ({"budget": 100, "scoring": "query_aware"}, 200),
        ({"budget": 4096, "scoring": "query_aware"}, 512),
        ({"budget": 256, "scoring": "query_aware", "block_size": 256}, 256),
    ],
)
def test_block_size_defaults_to_at_most_the_budget(kwargs, block):
    # A 512-token block at B = 256 kept 256 of 768 tokens per step and answered 10 of 60
    # agnostic 8k samples where a 256-token block answered 29: the default follows B.
    # Query-aware, the 512-token block answered more at B = 256 (36 against 34 of 140 at
    # 8k, 43 against 40 at 4k): there the default is min(512, 2 * B).
    config = BMRTConfig(**kwargs)
    assert config.block_tokens == block
    assert config.block_size == kwargs.get("block_size")  # the field keeps what was given
    assert BMRTConfig.from_dict(kwargs) == config


def test_a_default_block_follows_a_replaced_budget(llama):
    # The field stays None, so a budget set later (replace, or a BMRTCache override)
    # resolves the block again instead of keeping the old budget's.
    assert replace(BMRTConfig(budget=256), budget=2048).block_tokens == 512
    assert replace(BMRTConfig(budget=2048), budget=64).block_tokens == 64
    assert replace(BMRTConfig(budget=64), scoring="query_aware").block_tokens == 128
    cache = BMRTCache(llama, budget=64, protection_divisor=4)
    assert cache.layers[0].config.block_tokens == 64
    with pytest.raises(BMRTError, match="block_size=64"):
        # budget + block = 128 tokens at most in one forward
        cache.layers[0].update(torch.zeros(1, 2, 129, 16), torch.zeros(1, 2, 129, 16))


@settings(max_examples=40, deadline=None)
@given(block=st.integers(-10, 0))
def test_block_size_below_one_is_rejected(block):
    with pytest.raises(ValueError, match="block_size"):
        BMRTConfig(block_size=block)


@settings(max_examples=60, deadline=None)
@given(divisor=st.integers(3, 40), budget=st.integers(1, 120))
def test_budget_too_small_for_anchors_and_window(divisor, budget):
    fits = budget // divisor >= 1 and budget - 2 * (budget // divisor) >= 1
    if fits:
        assert BMRTConfig(budget=budget, protection_divisor=divisor).n_memory >= 1
    else:
        with pytest.raises(ValueError, match="budget"):
            BMRTConfig(budget=budget, protection_divisor=divisor)


@settings(max_examples=30, deadline=None)
@given(name=st.text(min_size=1, max_size=12).filter(lambda s: s not in SELECTORS))
def test_unknown_selector(name):
    with pytest.raises(ValueError, match="selector"):
        BMRTConfig(selector=name)


@settings(max_examples=30, deadline=None)
@given(name=st.text(min_size=1, max_size=12).filter(lambda s: s not in TIE_BREAKERS))
def test_unknown_tie_breaker(name):
    with pytest.raises(ValueError, match="tie_breaker"):
        BMRTConfig(selector="lsh", selector_options={"tie_breaker": name})


@pytest.mark.parametrize(
    ("field", "value"),
    [("scoring", "oracle"), ("positions", "relative"), ("granularity", "token")],
)
def test_unknown_modes(field, value):
    with pytest.raises(ValueError, match=field):
        BMRTConfig(**{field: value})


@pytest.mark.parametrize(
    ("selector", "options", "name"),
    [
        ("lsh", {"tables": 0}, "tables"),
        ("lsh", {"bits": 17}, "bits"),
        ("magicpig", {"bits": 0}, "bits"),
        ("snapkv", {"kernel": 4}, "kernel"),
        ("snapkv", {"window": 0}, "window"),
        ("exact", {"kernel": 2}, "kernel"),
        ("exact", {"kernel": 0}, "kernel"),
        ("hybrid", {"ratio": 1.5}, "ratio"),
        ("hybrid", {"primary": "hybrid"}, "primary"),
        ("hybrid", {"secondary": "nope"}, "selector"),
        ("exact", {"unknown_option": 1}, "selector_options"),
    ],
)
def test_bad_selector_options(selector, options, name):
    with pytest.raises(ValueError, match=name):
        BMRTConfig(selector=selector, selector_options=options)


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.5, float("nan"), "half", True])
def test_question_weight_outside_zero_one_is_rejected(weight):
    with pytest.raises(ValueError, match="question_weight"):
        BMRTConfig(scoring="query_aware", question_weight=weight)


# Issue #15: every field rejects wrong types and out-of-range values at construction, with
# BMRTError naming the field; nothing is coerced (True is not 1, 1.0 is not 1).
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", -1),
        ("seed", 2**64),
        ("seed", float("nan")),
        ("seed", 1.5),
        ("seed", "x"),
        ("seed", True),
        ("seed", 2**32),
        ("block_size", True),
        ("block_size", 1.0),
        ("block_size", 2**31),
        ("budget", True),
        ("budget", 1024.0),
        ("budget", 2**64),
        ("budget", float("inf")),
        ("protection_divisor", True),
        ("protection_divisor", 8.0),
        ("question_weight", float("inf")),
        ("question_weight", 10**400),
        ("question_weight", None),
        ("selector", []),
        ("selector", None),
        ("selector_options", []),
        ("selector_options", None),
        ("scoring", {}),
        ("positions", ["absolute"]),
        ("granularity", 0),
    ],
)
def test_bad_field_is_a_bmrt_error_naming_the_field(field, value):
    with pytest.raises(BMRTError, match=rf"BMRTConfig\.{field}"):
        BMRTConfig(**{field: value})


def test_seed_bounds_are_accepted_and_run_mid_stream(llama):
    # The largest seed must not fail later, when the layers seed their hash planes.
    for seed in (0, MAX_SEED):
        config = BMRTConfig(
            budget=12, protection_divisor=3, block_size=4, selector="lsh", seed=seed
        )
        cache = BMRTCache(llama, config)
        ids = torch.arange(20).view(1, 20) % 90
        with torch.no_grad():
            for block in ids.split(4, -1):
                llama(input_ids=block, past_key_values=cache)
        assert cache.stored_tokens == [12, 12]


def test_question_weight_one_as_int_is_stored_as_float():
    config = BMRTConfig(scoring="query_aware", question_weight=1)
    assert config.question_weight == 1.0 and type(config.question_weight) is float


@pytest.mark.parametrize(
    ("selector", "options", "match"),
    [
        ("exact", {"kernel": True}, r"selector 'exact' option 'kernel' must be an odd int"),
        ("exact", {"kernel": 3.0}, r"selector 'exact' option 'kernel'"),
        ("exact", {"kernel": 2**40 + 1}, r"selector 'exact' option 'kernel'"),
        ("snapkv", {"window": True}, r"selector 'snapkv' option 'window'"),
        ("snapkv", {"window": 2**64}, r"selector 'snapkv' option 'window'"),
        ("lsh", {"tables": True}, r"selector 'lsh' option 'tables'"),
        ("lsh", {"tables": 2**40}, r"selector 'lsh' option 'tables'"),
        ("lsh", {"bits": True}, r"selector 'lsh' option 'bits'"),
        ("lsh", {"tie_breaker": []}, r"selector 'lsh' option 'tie_breaker'"),
        ("magicpig", {"tables": 256}, r"selector 'magicpig' option 'tables'.*\[1, 255\]"),
        ("hybrid", {"ratio": True}, r"selector 'hybrid' option 'ratio'"),
        ("hybrid", {"ratio": float("nan")}, r"selector 'hybrid' option 'ratio'"),
        ("hybrid", {"primary": []}, r"selector 'hybrid' option 'primary'"),
        ("hybrid", {"primary_options": []}, r"'primary_options' must be a dict or None"),
        ("hybrid", {"secondary_options": ""}, r"'secondary_options' must be a dict or None"),
        (
            "hybrid",
            {"secondary_options": {"tables": 0}},
            r"'hybrid' option 'secondary_options': selector 'lsh' option 'tables'",
        ),
        ("h2o", {"kernel": 3}, r"selector_options of 'h2o': unknown option 'kernel'"),
        ("lsh", {"seed": 3}, r"selector_options of 'lsh': unknown option 'seed'"),
        ("lsh", {1: 3}, r"selector_options of 'lsh': unknown option 1"),
    ],
)
def test_bad_selector_option_names_selector_and_option(selector, options, match):
    with pytest.raises(BMRTError, match=match):
        BMRTConfig(selector=selector, selector_options=options)


def test_from_dict_rejects_unknown_fields():
    assert BMRTConfig.from_dict({"budget": 64, "seed": 3}) == BMRTConfig(budget=64, seed=3)
    with pytest.raises(BMRTError, match=r"unknown BMRTConfig fields \['budjet'\]"):
        BMRTConfig.from_dict({"budjet": 64})
    with pytest.raises(BMRTError, match=r"needs a dict"):
        BMRTConfig.from_dict([("budget", 64)])


def test_cache_revalidates_a_config_changed_after_construction(llama):
    config = BMRTConfig(selector="lsh")
    config.seed = -1
    with pytest.raises(BMRTError, match=r"BMRTConfig\.seed"):
        BMRTCache(llama, config)
    with pytest.raises(BMRTError, match=r"config must be a BMRTConfig"):
        BMRTCache(llama, {"budget": 64})
