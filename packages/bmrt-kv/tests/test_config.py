import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bmrt_kv import SELECTORS, TIE_BREAKERS, BMRTConfig


def test_defaults_split_the_budget():
    config = BMRTConfig(budget=1024, protection_divisor=8)
    assert (config.n_anchor, config.n_window, config.n_memory) == (128, 128, 768)


@settings(max_examples=40, deadline=None)
@given(divisor=st.integers(-5, 2))
def test_divisor_below_three_is_rejected(divisor):
    with pytest.raises(ValueError, match="protection_divisor"):
        BMRTConfig(budget=64, protection_divisor=divisor)


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
