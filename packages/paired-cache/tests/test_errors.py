"""Every bad input is a ValueError naming the numbers, and leaves the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_weights

from paired_cache import PairedCacheConfig, PairedCacheError
from paired_cache.cache import CacheInvariantError, PairedCache
from paired_cache.config import ENV_GRAIN, ENV_PAR_THRESHOLD, ENV_TAU

N, H = 12, 4


@pytest.fixture
def cache():
    gate, up, down = make_weights(N, H)
    c = PairedCache(up, down, gate, capacity=6)
    mask = torch.zeros(N, dtype=torch.bool)
    mask[[0, 3, 5]] = True
    c.update(mask)
    return c


def snapshot(c: PairedCache):
    return (
        c.mask(),
        c.active_indices(),
        c.index_to_position(),
        c.gate_up().clone(),
        c.active_down_T().clone(),
        c.stats,
    )


def assert_unchanged(c: PairedCache, before) -> None:
    after = snapshot(c)
    for a, b in zip(before[:5], after[:5], strict=True):
        assert torch.equal(a, b)
    assert before[5] == after[5]
    c.check_valid()


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (torch.zeros(N + 1, dtype=torch.bool), r"shape \(13,\), expected \(12,\)"),
        (torch.zeros(N - 1, dtype=torch.bool), r"shape \(11,\), expected \(12,\)"),
        (torch.zeros(2, N // 2, dtype=torch.bool), r"shape \(2, 6\), expected \(12,\)"),
        (torch.zeros(N, dtype=torch.uint8), r"dtype torch.bool, got torch.uint8"),
        (torch.zeros(N), r"dtype torch.bool, got torch.float32"),
        (np.zeros(N, dtype=np.int64), r"dtype bool, got numpy int64"),
        ([True] * N, r"bool torch.Tensor, got list"),
    ],
)
def test_bad_mask_is_rejected_and_cache_unchanged(cache, mask, match):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        cache.update(mask)
    assert_unchanged(cache, before)


def test_over_capacity_is_an_error_never_a_silent_drop(cache):
    # The published original copied only what fit and desynchronised its mask from the
    # active rows; here the update is refused whole.
    before = snapshot(cache)
    mask = torch.zeros(N, dtype=torch.bool)
    mask[:7] = True
    with pytest.raises(ValueError, match=r"selects 7 rows but capacity is 6"):
        cache.update(mask)
    assert_unchanged(cache, before)
    mask[6] = False
    cache.update(mask)  # exactly capacity is fine
    cache.check_valid()
    assert cache.num_active == 6


def test_numpy_bool_mask_is_accepted(cache):
    mask = np.zeros(N, dtype=bool)
    mask[[1, 2]] = True
    cache.update(mask)
    assert sorted(cache.active_indices().tolist()) == [1, 2]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda g, u, d: (g, u, d[:, :-1]), r"down has shape \(4, 11\), expected \[\?x12\]"),
        (lambda g, u, d: (g[:-1], u, d), r"gate has shape \(11, 4\), expected \[12x\?\]"),
        (lambda g, u, d: (g, u[0], d), r"up has shape \(4,\), expected \[\?x\?\]"),
        (lambda g, u, d: (g.double(), u, d), r"gate has dtype torch.float64 but up has"),
        (lambda g, u, d: (g, u, d.half()), r"down has dtype torch.float16 but up has"),
        (lambda g, u, d: (g, u.int(), d.int()), r"up has dtype torch.int32; supported"),
        (lambda g, u, d: (g, u.t().contiguous().t(), d), r"up with shape \(12, 4\) is not"),
        (lambda g, u, d: (g, u, d.t().contiguous().t()), r"down .* is not contiguous"),
        (lambda g, u, d: (g, u.numpy(), d), r"up must be a torch.Tensor, got ndarray"),
    ],
)
def test_bad_weights_are_rejected(change, match):
    gate, up, down = change(*make_weights(N, H))
    with pytest.raises(ValueError, match=match):
        PairedCache(up, down, gate)


@pytest.mark.parametrize("capacity", [0, N + 1, -3, 2.5, True])
def test_bad_capacity_is_rejected(capacity):
    gate, up, down = make_weights(N, H)
    with pytest.raises(
        ValueError, match=rf"capacity must be an int in \[1, N=12\], got {capacity}"
    ):
        PairedCache(up, down, gate, capacity=capacity)


def test_bad_init_mask_is_rejected_before_allocation():
    gate, up, down = make_weights(N, H)
    with pytest.raises(ValueError, match=r"expected \(12,\)"):
        PairedCache(up, down, gate, init_mask=torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hybrid_tau": -0.1}, r"hybrid_tau must be a number >= 0"),
        ({"hybrid_tau": float("nan")}, r"hybrid_tau must be a number >= 0"),
        ({"grain": 0}, r"grain must be in \[1, 2147483647\], got 0"),
        ({"par_threshold": -1}, r"par_threshold must be in \[0, 9223372036854775807\], got -1"),
        ({"num_threads": 0}, r"num_threads must be in \[1, 64\], got 0"),
        ({"num_threads": 65}, r"num_threads must be in \[1, 64\], got 65"),
        ({"grain": 2.0}, r"grain must be an int, got 2.0"),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PairedCacheConfig(**kwargs)


def test_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_TAU, "0.25")
    monkeypatch.setenv(ENV_GRAIN, "16")
    monkeypatch.setenv(ENV_PAR_THRESHOLD, "128")
    config = PairedCacheConfig()
    assert (config.hybrid_tau, config.grain, config.par_threshold) == (0.25, 16, 128)
    assert PairedCacheConfig(grain=8).grain == 8  # an argument beats the environment


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_GRAIN, "lots")
    with pytest.raises(ValueError, match=r"PAIRED_CACHE_GRAIN='lots' is not a valid int"):
        PairedCacheConfig()


def test_old_environment_names_are_refused_with_the_new_one(monkeypatch):
    monkeypatch.setenv("WEIGHT_CACHE_HYBRID_TAU_FRAC", "0.5")
    with pytest.raises(
        ValueError,
        match=r"WEIGHT_CACHE_HYBRID_TAU_FRAC is no longer read; set PAIRED_CACHE_HYBRID_TAU",
    ):
        PairedCacheConfig()


def test_gate_view_without_gate_is_an_error():
    _, up, down = make_weights(N, H)
    c = PairedCache(up, down)
    with pytest.raises(ValueError, match=r"without a gate"):
        c.gate()


def test_gate_rows_false_needs_a_gate_and_refuses_gate_views():
    gate, up, down = make_weights(N, H, gate_cols=H)
    with pytest.raises(ValueError, match=r"gate_rows=False needs a gate to leave in the pool"):
        PairedCache(up, down, gate_rows=False)
    with pytest.raises(ValueError, match=r"gate_rows must be a bool, got 0"):
        PairedCache(up, down, gate, gate_rows=0)
    c = PairedCache(up, down, gate, capacity=4, gate_rows=False)
    c.update(torch.arange(N) < 3)
    for view in (c.gate, c.gate_up):
        with pytest.raises(ValueError, match=r"keeps its gate in the pool only"):
            view()
    assert c.up().is_contiguous() and torch.equal(c.up(), up[:3])


def test_check_valid_reports_a_corrupted_row(cache):
    cache.gate_up()[1, 0] += 1.0  # the view aliases the C buffer
    with pytest.raises(CacheInvariantError, match=r"position 1 differs from pool row"):
        cache.check_valid()


# Issue #15: every argument is checked before the C core sees it; PairedCacheError names it.
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grain": 2**64}, r"grain must be in \[1, 2147483647\], got 18446744073709551616"),
        ({"grain": 2**31}, r"grain must be in \[1, 2147483647\]"),
        ({"grain": True}, r"grain must be an int, got True"),
        ({"par_threshold": 2**63}, r"par_threshold must be in \[0, 9223372036854775807\]"),
        ({"par_threshold": float("inf")}, r"par_threshold must be an int, got inf"),
        ({"num_threads": False}, r"num_threads must be an int, got False"),
        ({"num_threads": "4"}, r"num_threads must be an int, got '4'"),
        ({"hybrid_tau": True}, r"hybrid_tau must be a number >= 0"),
        ({"hybrid_tau": "1.8"}, r"hybrid_tau must be a number >= 0"),
        ({"hybrid_tau": 10**400}, r"does not fit a double; use math.inf"),
    ],
)
def test_out_of_range_config_is_a_paired_cache_error(kwargs, match):
    with pytest.raises(PairedCacheError, match=match):
        PairedCacheConfig(**kwargs)


def test_infinite_and_huge_int_tau_are_accepted():
    assert PairedCacheConfig(hybrid_tau=float("inf")).hybrid_tau == float("inf")
    assert PairedCacheConfig(hybrid_tau=2**64).hybrid_tau == float(2**64)


def test_config_changed_after_construction_is_rejected_before_the_core():
    # The reproducer: grain=2**64 used to overflow inside cffi.
    gate, up, down = make_weights(N, H)
    config = PairedCacheConfig()
    config.grain = 2**64
    with pytest.raises(PairedCacheError, match=r"grain must be in \[1, 2147483647\]"):
        PairedCache(up, down, gate, config=config)


def test_the_cache_keeps_its_own_copy_of_the_config():
    gate, up, down = make_weights(N, H)
    config = PairedCacheConfig(grain=4)
    c = PairedCache(up, down, gate, config=config)
    config.grain = 2**64
    assert c.config.grain == 4 and c.config is not config
    mask = torch.zeros(N, dtype=torch.bool)
    mask[:5] = True
    c.update(mask)
    c.check_valid()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda g, u, d: (g, u[:0], d[:, :0]), r"up has shape \(0, 4\); every dimension"),
        (lambda g, u, d: (g[:, :0], u, d), r"gate has shape \(12, 0\); every dimension"),
        (lambda g, u, d: (g, u[:, :0], d), r"up has shape \(12, 0\); every dimension"),
        (lambda g, u, d: (g, u, d[:0]), r"down has shape \(0, 12\); every dimension"),
        (lambda g, u, d: (g, u.to_sparse(), d), r"up must be a dense \(strided\) tensor"),
        (lambda g, u, d: (g, u, d.to("meta")), r"down must be on the CPU, got device meta"),
        (lambda g, u, d: (7, u, d), r"gate must be a torch.Tensor, got int"),
    ],
)
def test_degenerate_weights_are_rejected(change, match):
    gate, up, down = change(*make_weights(N, H))
    with pytest.raises(PairedCacheError, match=match):
        PairedCache(up, down, gate)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (torch.zeros(N, dtype=torch.bool).to_sparse(), r"dense \(strided\) tensor"),
        (torch.zeros(N, dtype=torch.bool, device="meta"), r"on the CPU, got device meta"),
        (torch.tensor(True), r"shape \(\), expected \(12,\)"),
        (None, r"bool torch.Tensor, got NoneType"),
        (np.zeros((2, N), dtype=bool), r"shape \(2, 12\), expected \(12,\)"),
    ],
)
def test_more_bad_masks_are_rejected_and_cache_unchanged(cache, mask, match):
    before = snapshot(cache)
    with pytest.raises(PairedCacheError, match=match):
        cache.update(mask)
    assert_unchanged(cache, before)


def test_init_mask_over_capacity_is_rejected_before_allocation():
    gate, up, down = make_weights(N, H)
    with pytest.raises(PairedCacheError, match=r"init_mask selects 12 rows but capacity is 3"):
        PairedCache(up, down, gate, capacity=3, init_mask=torch.ones(N, dtype=torch.bool))


def test_weights_that_require_grad_are_copied_as_data():
    gate, up, down = (t.requires_grad_() for t in make_weights(N, H))
    c = PairedCache(up, down, gate, init_mask=torch.ones(N, dtype=torch.bool))
    assert not c.gate_up().requires_grad
    assert torch.equal(c.gate_up(), torch.cat([gate, up], 1).detach())
    c.check_valid()
