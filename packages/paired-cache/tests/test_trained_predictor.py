"""The trained predictors (gated and linear): fitted on a tiny model they recall the
oracle's rows; on SmolLM2 the gated one recalls more than CATS, and the linear one holds on
text it was not fitted on."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_tiny_llama, make_weights

from paired_cache import PairedCacheError
from paired_cache.mask_sources import OracleTopK
from paired_cache.registry import MASK_SOURCES, make_source
from paired_cache.sparse_mlp import collect_mlp_inputs
from paired_cache.trained_predictor import (
    FORMAT,
    PredictorFit,
    TrainConfig,
    TrainedPredictor,
    expected_abs,
    fit_predictor,
    fit_predictors,
    load_predictors,
    oracle_labels,
    python_docs_ids,
    recall,
    save_predictors,
)

N, H = 96, 24


def _inputs(t: int, seed: int) -> torch.Tensor:
    # Inputs with structure, as a model's are: a few directions carry most of the energy.
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(6, H, generator=torch.Generator().manual_seed(99))
    return torch.randn(t, 6, generator=gen) @ basis + 0.1 * torch.randn(t, H, generator=gen)


@pytest.mark.parametrize("kind", ["gated", "linear"])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_trained_predictor_recalls_more_than_a_random_mask(fraction, kind):
    gate, up, _ = make_weights(N, H, seed=3)
    act = torch.nn.SiLU()
    weights = fit_predictor(gate, up, act, _inputs(1024, 0), TrainConfig(rank=12, kind=kind))
    source = make_source("trained", gate, up, act, fraction, weights=weights)
    assert isinstance(source, TrainedPredictor) and MASK_SOURCES["trained"] is TrainedPredictor
    assert source.kind == kind
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


@pytest.mark.parametrize("kind", ["gated", "linear"])
def test_fit_predictors_streams_what_fit_predictor_fits_at_once(kind):
    # 300 tokens as windows of 64, two at a time, and a last window of 44 on its own: the
    # sums accumulated batch by batch give the fit of all the inputs at once.
    model = make_tiny_llama(seed=1)
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(2))
    config = TrainConfig(rank=8, kind=kind)
    streamed = fit_predictors(model, ids, config, window=64, batch=2)
    inputs = [collect_mlp_inputs(model, w) for w in (ids[:256].view(4, 64), ids[256:][None])]
    probe = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    for i, name in enumerate(["model.layers.0.mlp", "model.layers.1.mlp"]):
        mlp = model.model.layers[i].mlp
        x = torch.cat([part[name] for part in inputs])  # (300, hidden)
        assert x.shape == (300, 32)
        at_once = fit_predictor(mlp.gate_proj.weight, mlp.up_proj.weight, mlp.act_fn, x, config)
        # Eigenvectors are defined up to sign: compare what the factors compute.
        if kind == "linear":
            outputs = [
                (probe @ w["proj_in"]) @ w["proj_out"] + w["bias"]
                for w in (streamed[name], at_once)
            ]
        else:
            outputs = [
                torch.cat([(probe @ w["up_in"]) @ w["up_out"], w["up_sd"][None]])
                for w in (streamed[name], at_once)
            ]
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)


def test_gated_predictor_fits_up_and_what_rank_r_leaves_out():
    # At full rank the prediction is up x itself, nothing is left out (up_sd 0) and the
    # mask is the oracle's. At rank r, up_sd is the root mean square, per neuron, of
    # up x minus its prediction over the calibration inputs.
    gate, up, _ = make_weights(N, H, seed=2)
    act = torch.nn.SiLU()
    x = _inputs(512, 0)
    full = fit_predictor(gate, up, act, x, TrainConfig(rank=H))
    torch.testing.assert_close((x @ full["up_in"]) @ full["up_out"], x @ up.T, atol=1e-4, rtol=1e-4)
    assert float(full["up_sd"].max()) < 1e-3 * float((x @ up.T).abs().mean())
    source, oracle = TrainedPredictor(gate, up, act, 0.5, full), OracleTopK(gate, up, act, 0.5)
    assert all(torch.equal(source.select(t), oracle.select(t)) for t in x[:20])
    low = fit_predictor(gate, up, act, x, TrainConfig(rank=3))
    left = x @ up.T - (x @ low["up_in"]) @ low["up_out"]  # (T, N)
    torch.testing.assert_close(low["up_sd"], left.pow(2).mean(0).sqrt(), rtol=1e-3, atol=1e-5)


def test_expected_abs_is_the_mean_of_a_folded_normal():
    mean = torch.tensor([0.0, 1.0, -2.0, 0.3, 5.0, -0.7])
    sd = torch.tensor([1.0, 0.5, 2.0, 0.0, 1e-3, 0.0])
    samples = mean + sd * torch.randn(200_000, 6, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(expected_abs(mean, sd), samples.abs().mean(0), atol=0.01, rtol=0.01)
    assert expected_abs(mean, sd)[3] == 0.3 and expected_abs(mean, sd)[5] == 0.7


def test_linear_predictor_on_smollm2_holds_on_text_it_was_not_fitted_on(smollm2):
    # The defect this guards against: the BCE-trained predictor of 0.6 fitted ~1,000
    # tokens and recalled 0.78 of layer 12's oracle rows on them but 0.55-0.57 on held-out
    # text (a random half: 0.5). Fitted on 2,048 tokens of documentation, it must hold on
    # English prose it has not seen: above 0.57, and within 0.15 of its calibration recall
    # (0.6: 0.22 apart).
    model, tokenizer = smollm2
    name = "model.layers.12.mlp"
    calibration = collect_mlp_inputs(model, python_docs_ids(tokenizer, 2048)[0].view(4, 512))[name]
    prose = "The river rises in the hills and runs to the sea past farms, mills and towns. " * 6
    held_out = collect_mlp_inputs(model, tokenizer(prose, return_tensors="pt").input_ids)[name]
    mlp = model.get_submodule(name)
    g, u = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()
    weights = fit_predictor(g, u, mlp.act_fn, calibration, TrainConfig(rank=128, kind="linear"))
    source = TrainedPredictor(g, u, mlp.act_fn, 0.5, weights)

    def recall_on(x):
        predicted = torch.stack([source.select(t) for t in x])
        return recall(predicted, oracle_labels(g, u, mlp.act_fn, x, source.k))

    fitted, unseen = recall_on(calibration[:512]), recall_on(held_out)
    assert unseen > 0.57, (fitted, unseen)
    assert fitted - unseen < 0.15, (fitted, unseen)


def test_gated_predictor_on_smollm2_recalls_more_than_cats_and_needs_its_spread(smollm2):
    # The gated predictor adds a rank-64 prediction of up x to CATS's exact gate. On the
    # held-out prose (layers 12 and 24, 50% active rows) it must recall more of the
    # oracle's rows than CATS, and more than the same prediction scored without up_sd (a
    # neuron whose up x rank 64 captures badly then looks idle and is dropped; over the
    # whole model that was perplexity 43 against 32 with up_sd, at rank 32). Measured:
    # 0.727 / 0.745 against CATS 0.697 / 0.718 and 0.698 / 0.718 without up_sd.
    model, tokenizer = smollm2
    names = ["model.layers.12.mlp", "model.layers.24.mlp"]
    calibration = collect_mlp_inputs(model, python_docs_ids(tokenizer, 2048)[0].view(4, 512))
    prose = "The river rises in the hills and runs to the sea past farms, mills and towns. " * 6
    held_out = collect_mlp_inputs(model, tokenizer(prose, return_tensors="pt").input_ids)
    for name in names:
        mlp = model.get_submodule(name)
        g, u, act = mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.act_fn
        weights = fit_predictor(g, u, act, calibration[name], TrainConfig(rank=64))
        flat = dict(weights, up_sd=torch.zeros_like(weights["up_sd"]))
        x = held_out[name]
        oracle = oracle_labels(g, u, act, x, OracleTopK(g, u, act, 0.5).k)

        def recall_of(source, x=x, oracle=oracle):
            return recall(torch.stack([source.select(t) for t in x]), oracle)

        gated = recall_of(TrainedPredictor(g, u, act, 0.5, weights))
        cats = recall_of(make_source("cats", g, u, act, 0.5))
        no_spread = recall_of(TrainedPredictor(g, u, act, 0.5, flat))
        assert gated > cats + 0.02, (name, gated, cats)
        assert gated > no_spread + 0.02, (name, gated, no_spread)


@pytest.mark.parametrize("kind, fmt", [("gated", "paired-cache-predictor-2"), ("linear", FORMAT)])
def test_predictors_round_trip_through_safetensors(tmp_path, kind, fmt):
    from safetensors import safe_open

    gate, up, _ = make_weights(N, H, seed=1)
    config = TrainConfig(rank=4, kind=kind)
    weights = fit_predictor(gate, up, torch.nn.SiLU(), _inputs(64, 0), config)
    path = tmp_path / "p.safetensors"
    save_predictors(path, {"model.layers.0.mlp": weights})
    loaded = load_predictors(path)
    assert set(loaded) == {"model.layers.0.mlp"}
    assert all(torch.equal(loaded["model.layers.0.mlp"][k], v) for k, v in weights.items())
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]
    # A file of linear predictors keeps the format 0.6-0.7 read; a gated one is format 2.
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == fmt


def test_load_predictors_refuses_parts_of_no_kind_and_gated_parts_in_a_format_1_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "p.safetensors"
    parts = {
        "model.layers.0.mlp.up_in": torch.zeros(H, 2),
        "model.layers.0.mlp.bias": torch.zeros(N),
    }
    save_file(parts, str(path), metadata={"format": "paired-cache-predictor-2"})
    with pytest.raises(PairedCacheError, match=r"model.layers.0.mlp: predictor weights must be"):
        load_predictors(path)
    gated = fit_predictor(*make_weights(N, H, seed=1)[:2], torch.nn.SiLU(), _inputs(64, 0))
    tensors = {f"model.layers.0.mlp.{k}": v for k, v in gated.items()}
    save_file(tensors, str(path), metadata={"format": FORMAT})
    with pytest.raises(
        PairedCacheError, match=r"is a gated predictor in a paired-cache-predictor-1"
    ):
        load_predictors(path)


def test_bad_predictor_inputs_are_refused(tmp_path):
    gate, up, _ = make_weights(N, H, seed=1)
    act = torch.nn.SiLU()
    with pytest.raises(PairedCacheError, match=r"'trained' needs weights="):
        make_source("trained", gate, up, act, 0.5)
    bad = {"proj_in": torch.zeros(H, 4), "proj_out": torch.zeros(4, N + 1), "bias": torch.zeros(N)}
    with pytest.raises(PairedCacheError, match=r"do not fit hidden=24, N=96"):
        make_source("trained", gate, up, act, 0.5, weights=bad)
    bad = {"up_in": torch.zeros(H, 4), "up_out": torch.zeros(4, N), "up_sd": torch.zeros(N - 1)}
    with pytest.raises(PairedCacheError, match=r"up_sd \(95,\) do not fit hidden=24, N=96"):
        make_source("trained", gate, up, act, 0.5, weights=bad)
    bad["up_sd"] = torch.full((N,), -1.0)
    with pytest.raises(PairedCacheError, match=r"up_sd must be finite and >= 0"):
        make_source("trained", gate, up, act, 0.5, weights=bad)
    with pytest.raises(
        PairedCacheError, match=r"predictor weights must be .*got \['bias', 'up_in'\]"
    ):
        make_source("trained", gate, up, act, 0.5, weights={"up_in": 1, "bias": 2})
    with pytest.raises(PairedCacheError, match=r"rank must be an int >= 1"):
        TrainConfig(rank=0)
    with pytest.raises(PairedCacheError, match=r"kind must be one of \('gated', 'linear'\)"):
        TrainConfig(kind="relu")
    fit = PredictorFit(gate, up, act, "gated")
    fit.add(_inputs(8, 0))
    with pytest.raises(PairedCacheError, match=r"accumulated for a 'gated' predictor"):
        fit.solve(TrainConfig(kind="linear"))
    with pytest.raises(PairedCacheError, match=r"rank must be in \[1, min\(hidden, N\)=24\]"):
        fit_predictor(gate, up, act, _inputs(8, 0), TrainConfig(rank=25))
    with pytest.raises(PairedCacheError, match=r"ridge must be a finite number >= 0"):
        TrainConfig(ridge=-1.0)
    with pytest.raises(PairedCacheError, match=r"no calibration inputs"):
        PredictorFit(gate, up, act).solve(TrainConfig(rank=4))
    with pytest.raises(PairedCacheError, match=r"rank must be in \[1, min\(hidden, N\)=24\]"):
        fit.solve(TrainConfig(rank=25))
    with pytest.raises(PairedCacheError, match=r"expected \(T, 24\)"):
        PredictorFit(gate, up, act).add(torch.zeros(4, 23))
    model = make_tiny_llama()
    with pytest.raises(PairedCacheError, match=r"window must be an int >= 1"):
        fit_predictors(model, torch.arange(20), window=0)
    with pytest.raises(PairedCacheError, match=r"integer tensor of token ids"):
        fit_predictors(model, torch.zeros(20))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(PairedCacheError, match=r"junk.safetensors"):
        load_predictors(junk)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_predictor_file_takes_the_process_umask(tmp_path, umask, mode):
    gate, up, _ = make_weights(N, H, seed=1)
    weights = fit_predictor(gate, up, torch.nn.SiLU(), _inputs(64, 0), TrainConfig(rank=4))
    old = os.umask(umask)
    try:
        save_predictors(tmp_path / "p.safetensors", {"model.layers.0.mlp": weights})
    finally:
        os.umask(old)
    assert (tmp_path / "p.safetensors").stat().st_mode & 0o777 == mode
