"""The Deja Vu predictor: trained on a tiny model, it recalls the oracle's rows."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_weights

from paired_cache import PairedCacheError
from paired_cache.mask_sources import MASK_SOURCES, OracleTopK, make_source
from paired_cache.trained_predictor import (
    TrainConfig,
    TrainedPredictor,
    fit_predictor,
    load_predictors,
    oracle_labels,
    recall,
    save_predictors,
)

N, H = 96, 24


def _inputs(t: int, seed: int) -> torch.Tensor:
    # Inputs with structure, as a model's are: a few directions carry most of the energy.
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(6, H, generator=torch.Generator().manual_seed(99))
    return torch.randn(t, 6, generator=gen) @ basis + 0.1 * torch.randn(t, H, generator=gen)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_trained_predictor_recalls_more_than_a_random_mask(fraction):
    gate, up, _ = make_weights(N, H, seed=3)
    act = torch.nn.SiLU()
    weights = fit_predictor(
        gate, up, act, fraction, _inputs(1024, 0), TrainConfig(rank=12, steps=200)
    )
    source = make_source("trained", gate, up, act, fraction, weights=weights)
    assert isinstance(source, TrainedPredictor) and MASK_SOURCES["trained"] is TrainedPredictor
    held_out = _inputs(200, 1)
    oracle = oracle_labels(gate, up, act, held_out, source.k)
    predicted = torch.stack([source.select(x) for x in held_out])
    assert (predicted.sum(1) == source.k).all()
    gen = torch.Generator().manual_seed(5)
    random = torch.stack([torch.randperm(N, generator=gen) < source.k for _ in held_out])
    got, chance = recall(predicted, oracle), recall(random, oracle)
    assert chance == pytest.approx(fraction, abs=0.05)
    assert got > chance + 0.25, (got, chance)
    # oracle_labels is the OracleTopK mask, token by token.
    ref = OracleTopK(gate, up, act, fraction)
    assert all(torch.equal(oracle[t], ref.select(held_out[t])) for t in range(5))


def test_predictors_round_trip_through_safetensors(tmp_path):
    gate, up, _ = make_weights(N, H, seed=1)
    weights = fit_predictor(
        gate, up, torch.nn.SiLU(), 0.5, _inputs(64, 0), TrainConfig(rank=4, steps=3)
    )
    path = tmp_path / "p.safetensors"
    save_predictors(path, {"model.layers.0.mlp": weights}, 0.5)
    loaded = load_predictors(path)
    assert set(loaded) == {"model.layers.0.mlp"}
    assert all(torch.equal(loaded["model.layers.0.mlp"][k], v) for k, v in weights.items())
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]


def test_bad_predictor_inputs_are_refused(tmp_path):
    gate, up, _ = make_weights(N, H, seed=1)
    act = torch.nn.SiLU()
    with pytest.raises(PairedCacheError, match=r"'trained' needs weights="):
        make_source("trained", gate, up, act, 0.5)
    bad = {"proj_in": torch.zeros(H, 4), "proj_out": torch.zeros(4, N + 1), "bias": torch.zeros(N)}
    with pytest.raises(PairedCacheError, match=r"do not fit hidden=24, N=96"):
        make_source("trained", gate, up, act, 0.5, weights=bad)
    with pytest.raises(PairedCacheError, match=r"rank must be an int >= 1"):
        TrainConfig(rank=0)
    with pytest.raises(PairedCacheError, match=r"rank must be in \[1, min\(hidden, N\)=24\]"):
        fit_predictor(gate, up, act, 0.5, _inputs(8, 0), TrainConfig(rank=25))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(PairedCacheError, match=r"junk.safetensors"):
        load_predictors(junk)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_predictor_file_takes_the_process_umask(tmp_path, umask, mode):
    gate, up, _ = make_weights(N, H, seed=1)
    weights = fit_predictor(
        gate, up, torch.nn.SiLU(), 0.5, _inputs(64, 0), TrainConfig(rank=4, steps=1)
    )
    old = os.umask(umask)
    try:
        save_predictors(tmp_path / "p.safetensors", {"model.layers.0.mlp": weights}, 0.5)
    finally:
        os.umask(old)
    assert (tmp_path / "p.safetensors").stat().st_mode & 0o777 == mode
