"""``capacity`` (experts per layer) and ``capacity_share`` (a share of each layer's
experts): at most one is given, and ``1`` and ``1.0`` no longer mean different things
through one parameter (#56)."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_expert_cache import ExpertCacheConfig, ExpertCacheError, config_from_state
from moe_expert_cache.config import DEFAULT_CAPACITY_SHARE


def test_one_expert_and_every_expert_are_two_parameters():
    assert ExpertCacheConfig(capacity=1).layer_capacities([8, 8], 1) == [1, 1]
    assert ExpertCacheConfig(capacity_share=1.0).layer_capacities([8, 8], 1) == [8, 8]
    # The parameter, not the type, says which: an int share is still a share.
    assert ExpertCacheConfig(capacity_share=1).layer_capacities([8, 16], 1) == [8, 16]
    assert ExpertCacheConfig(capacity_share=1).capacity_share == 1.0


def test_neither_gives_the_default_share():
    config = ExpertCacheConfig()
    assert config.capacity is None and config.capacity_share is None
    assert DEFAULT_CAPACITY_SHARE == 0.5
    assert config.layer_capacities([8, 16], 2) == [4, 8]


@pytest.mark.parametrize(
    "given",
    [
        {"capacity": 4, "capacity_share": 0.5},
        {"capacity": [4, 4], "capacity_share": 0.5},
        {"capacity": 0.5, "capacity_share": 0.5},  # a deprecated float share and a share
    ],
)
def test_both_given_is_refused_naming_both(given):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any deprecation warning
        with pytest.raises(ExpertCacheError, match=r"capacity .* capacity_share .*not both"):
            ExpertCacheConfig(**given)


@pytest.mark.parametrize("share", [0.5, 1.0, np.float32(0.25)])
def test_a_float_capacity_is_a_deprecated_share(share):
    with pytest.warns(DeprecationWarning, match="capacity_share=") as record:
        config = ExpertCacheConfig(capacity=share)
    assert record[0].filename == __file__  # points at the caller's line
    assert config.capacity is None and config.capacity_share == float(share)
    assert config == ExpertCacheConfig(capacity_share=float(share))


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"capacity": "4"}, "capacity must be an int"),
        ({"capacity": True}, "capacity must be an int"),
        ({"capacity": [4, 1.5]}, "per-layer capacity must be a list of ints"),
        ({"capacity_share": 0}, r"capacity_share must be a number in \(0, 1\]"),
        ({"capacity_share": 1.5}, r"capacity_share must be a number in \(0, 1\]"),
        ({"capacity_share": math.nan}, r"capacity_share must be a number in \(0, 1\]"),
        ({"capacity_share": True}, r"capacity_share must be a number in \(0, 1\]"),
        ({"capacity_share": "0.5"}, r"capacity_share must be a number in \(0, 1\]"),
    ],
)
def test_bad_capacity_values_name_the_parameter(given, match):
    with pytest.raises(ExpertCacheError, match=match):
        ExpertCacheConfig(**given)


@given(experts=st.integers(2, 64), data=st.data())
def test_a_count_and_its_share_give_the_same_experts(experts, data):
    top_k = data.draw(st.integers(1, experts))
    count = data.draw(st.integers(top_k, experts))
    by_count = ExpertCacheConfig(capacity=count).layer_capacities([experts] * 3, top_k)
    by_share = ExpertCacheConfig(capacity_share=count / experts)
    assert by_count == by_share.layer_capacities([experts] * 3, top_k) == [count] * 3


def test_a_warm_start_replaces_a_share_with_counts():
    state = {"resident": [[0, 1, 2], [3, 4]], "pinned": [[0], []], "num_experts": [8, 8]}
    config = config_from_state(ExpertCacheConfig(capacity_share=0.25), {**state, "top_k": 2})
    assert config.capacity == [3, 2] and config.capacity_share is None
    assert config.layer_capacities([8, 8], 2) == [3, 2]
    assert replace(ExpertCacheConfig(), capacity=4).layer_capacities([8], 2) == [4]


def test_the_old_name_is_a_deprecated_alias_in_the_config_module_only():
    import moe_expert_cache
    from moe_expert_cache import config

    with pytest.warns(DeprecationWarning, match="ExpertCacheConfig"):
        assert config.CacheConfig is ExpertCacheConfig
    assert not hasattr(moe_expert_cache, "CacheConfig")
    with pytest.raises(AttributeError):
        config.NoSuchName  # noqa: B018
