"""Policies, the simulator, Belady, traces and profiles."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import PROMPT
from hypothesis import given, settings

from moe_expert_cache import ExpertCacheConfig, ExpertCacheError, generate, load_cached_model
from moe_expert_cache.policies import make_policy
from moe_expert_cache.profile import adaptive_capacity, pinned_experts
from moe_expert_cache.simulator import replay_layer, simulate, synthetic_trace
from moe_expert_cache.trace import RouterTrace


def test_policy_orders():
    p = {name: make_policy(name, 4) for name in ("lru", "lfu", "lcp")}
    for pol in p.values():
        for t, e in enumerate([0, 0, 0, 1, 2, 3]):
            pol.record([e], t)
    cands = [0, 1, 2, 3]
    assert p["lru"].choose_victims(cands, 1, 6) == [0]  # used longest ago
    assert p["lfu"].choose_victims(cands, 1, 6) == [1]  # least often, oldest among ties
    # LCP: 3 recent uses outrank one ...
    assert p["lcp"].choose_victims(cands, 1, 6) == [1]
    # ... but not once they are old: 3 * 0.25 ** (201 / 128) < 1 * 0.25 ** (3 / 128)
    late = make_policy("lcp", 4)
    for t, e in [(0, 0), (1, 0), (2, 0), (200, 1), (201, 2), (202, 3)]:
        late.record([e], t)
    assert late.choose_victims(cands, 1, 203) == [0]


rows = st.lists(
    st.lists(st.integers(0, 7), min_size=2, max_size=2, unique=True), min_size=1, max_size=60
)


@settings(max_examples=60, deadline=None)
@given(requests=rows, capacity=st.integers(2, 8))
def test_belady_is_never_beaten(requests, capacity):
    req = np.array(requests, dtype=np.int32)
    best = replay_layer(req, 8, capacity, "belady")
    for policy in ("lru", "lfu", "lcp"):
        assert replay_layer(req, 8, capacity, policy) <= best
    if capacity == 8:
        assert best == req.size


@settings(max_examples=40, deadline=None)
@given(requests=rows, layer_count=st.integers(1, 3))
def test_trace_round_trip(tmp_path_factory, requests, layer_count):
    req = np.array(requests, dtype=np.int32)
    trace = RouterTrace.from_requests([req] * layer_count, 8)
    path = tmp_path_factory.mktemp("t") / "x.trace"
    trace.save(path)
    back = RouterTrace.load(path)
    assert np.array_equal(back.rows(), trace.rows())
    assert np.array_equal(back.layer_requests(layer_count - 1), req)


def test_corrupted_trace(tmp_path):
    trace = synthetic_trace(1, 8, 2, 20)
    trace.save(tmp_path / "t")
    data = bytearray((tmp_path / "t").read_bytes())
    data[-1] ^= 1
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        RouterTrace.load(tmp_path / "bad")
    (tmp_path / "short").write_bytes(bytes(data[:-4]))
    with pytest.raises(ExpertCacheError, match="checksum"):
        RouterTrace.load(tmp_path / "short")


def test_live_exact_cache_matches_its_simulation(model_dir):
    """The simulator replays the live cache: same policy, same hits, token for token."""
    cached = load_cached_model(model_dir("qwen3_moe"), ExpertCacheConfig(capacity=3, policy="lcp"))
    trace = cached.manager.start_trace()
    generate(cached.model, PROMPT[:1], 24, cached.manager)
    (row,) = simulate(trace, [3], ["lcp"])
    total = cached.manager.total_metrics()
    assert (row.hits, row.requests) == (total.hits, total.requests)


def test_simulate_rejects_bad_capacity():
    with pytest.raises(ValueError, match="top_k"):
        simulate(synthetic_trace(1, 8, 2, 10), [1])


def test_profiles():
    req = np.array([[0, 1], [0, 2], [0, 3], [0, 1]], dtype=np.int32)
    flat = np.array([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=np.int32)
    trace = RouterTrace.from_requests([req, flat], 8)
    assert pinned_experts(trace, 0.4) == {0: [0, 1], 1: []}
    assert pinned_experts(trace, 0.4, max_per_layer=1)[0] == [0]
    # Layer 0 needs only {0, 1} for every token; the flat layer gets the other slots.
    narrow = RouterTrace.from_requests([np.array([[0, 1]] * 4, dtype=np.int32), flat], 8)
    assert adaptive_capacity(narrow, 8) == [2, 6]
    with pytest.raises(ValueError, match="total"):
        adaptive_capacity(trace, 3)


def test_lcp_constants_reach_the_replayed_policy():
    trace = synthetic_trace(2, 8, 2, 200, seed=3)
    default = simulate(trace, [4], ["lcp"])
    assert simulate(trace, [4], ["lcp"], lcp=(0.25, 128.0)) == default
    others = [simulate(trace, [4], ["lcp"], lcp=c)[0].hits for c in ((0.01, 1.0), (0.99, 1e4))]
    assert len({default[0].hits, *others}) > 1  # the constants change the evictions
    with pytest.raises(ValueError, match="decay"):
        simulate(trace, [4], ["lcp"], lcp=(1.5, 8.0))
