"""Every bad input is a ValueError naming the numbers, and leaves the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_weights

from paired_cache import CacheConfig, CacheInvariantError, PairedCache
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
        ({"grain": 0}, r"grain must be >= 1, got 0"),
        ({"par_threshold": -1}, r"par_threshold must be >= 0, got -1"),
        ({"num_threads": 0}, r"num_threads must be in \[1, 64\], got 0"),
        ({"num_threads": 65}, r"num_threads must be in \[1, 64\], got 65"),
        ({"grain": 2.0}, r"grain must be an int, got 2.0"),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_TAU, "0.25")
    monkeypatch.setenv(ENV_GRAIN, "16")
    monkeypatch.setenv(ENV_PAR_THRESHOLD, "128")
    config = CacheConfig()
    assert (config.hybrid_tau, config.grain, config.par_threshold) == (0.25, 16, 128)
    assert CacheConfig(grain=8).grain == 8  # an argument beats the environment


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_GRAIN, "lots")
    with pytest.raises(ValueError, match=r"WEIGHT_CACHE_GRAIN='lots' is not a valid int"):
        CacheConfig()


def test_gate_view_without_gate_is_an_error():
    _, up, down = make_weights(N, H)
    c = PairedCache(up, down)
    with pytest.raises(ValueError, match=r"without a gate"):
        c.gate()


def test_check_valid_reports_a_corrupted_row(cache):
    cache.gate_up()[1, 0] += 1.0  # the view aliases the C buffer
    with pytest.raises(CacheInvariantError, match=r"position 1 differs from pool row"):
        cache.check_valid()
