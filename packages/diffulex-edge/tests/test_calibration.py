"""8da4w's calibrated int4 clipping (diffulex_edge.calibration): the search never rounds a
group worse than min-max, torchao rounds a clipped group on exactly the grid the search
scored, and bad calibration input is refused before the model changes. Its effect on a real
model's perplexity is measured in benchmarks/smollm2_quant_texts.py, not here."""

import copy

import pytest
import torch
from random_sdar import random_model

from diffulex_edge.calibration import (
    CLIP_RATIOS,
    calibration_ids,
    calibration_text,
    clipped_weight,
    group_covariances,
    int4_grid,
    random_ids,
)
from diffulex_edge.cli import main
from diffulex_edge.config import tiny_config
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.export import MIXED_INT8_LAYERS, quantize_8da4w


def output_error(weight, covariance, rounded):
    """Each group's e^T C e, e its rounding error and C its input covariance."""
    error = (rounded - weight).reshape(weight.shape[0], -1, 32)
    return torch.einsum("rgi,gij,rgj->rg", error, covariance, error)


def min_max(weight):
    groups = weight.reshape(weight.shape[0], -1, 32)
    return int4_grid(groups, groups.abs().amax(-1, keepdim=True)).reshape(weight.shape)


def test_the_search_never_rounds_a_group_worse_than_min_max():
    """Heavy-tailed weights (a few large ones per group, as trained LLM weights have) and
    correlated inputs of uneven scale: every group's output error is at most min-max's
    (ratio 1.0 is among the ratios searched), and most are strictly smaller."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.distributions.StudentT(3.0).sample((64, 256)) * 0.02
    mix = torch.randn(8, 32, 64, generator=generator) * torch.rand(8, 32, 1, generator=generator)
    covariance = mix @ mix.transpose(1, 2) / 64  # (groups, 32, 32), positive semi-definite
    clipped = clipped_weight(weight, covariance, 32)
    groups = clipped.reshape(64, -1, 32)
    ours = int4_grid(groups, groups.abs().amax(-1, keepdim=True)).reshape(weight.shape)
    searched = output_error(weight, covariance, ours)
    baseline = output_error(weight, covariance, min_max(weight))
    assert bool((searched <= baseline * (1 + 1e-5)).all())
    assert (searched < baseline).float().mean() > 0.5
    assert searched.sum() < 0.8 * baseline.sum()
    # Clipping only: nothing grows, and each group's edge is one of the searched ratios.
    assert bool((clipped.abs() <= weight.abs()).all())
    ratio = groups.abs().amax(-1) / weight.reshape(64, -1, 32).abs().amax(-1)
    assert bool(torch.isclose(ratio[..., None], torch.tensor(CLIP_RATIOS)).any(-1).all())


@pytest.mark.parametrize("int8_layers", [(), MIXED_INT8_LAYERS])
def test_torchao_rounds_each_clipped_group_on_the_searched_grid(int8_layers):
    """The program is an ordinary 8da4w one: each int4 weight torchao holds dequantizes to
    int4_grid of the clipped weight, exactly; the int8 layers are not clipped."""
    model = random_model(tiny_config(), seed=1)
    ids = random_ids(model.config.vocab_size, 96, seed=3)
    int4 = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in int8_layers
    }
    covariances = group_covariances(model, ids, int4, 32)
    expected = {}
    for name, m in int4.items():
        groups = clipped_weight(m.weight, covariances[name], 32).reshape(m.out_features, -1, 32)
        expected[name] = int4_grid(groups, groups.abs().amax(-1, keepdim=True)).flatten(1)
    quantized = quantize_8da4w(copy.deepcopy(model), int8_layers=int8_layers, calibration=ids)
    changed = 0
    for name, want in expected.items():
        got = quantized.get_submodule(name).weight.dequantize()
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        changed += not torch.equal(want, min_max(model.get_submodule(name).weight.detach()))
    assert changed == len(expected)  # the search moved some group of every layer
    # The tied embedding is int8 per row, not int4: within half a step of its float rows.
    table = model.embed_tokens.weight
    step = table.abs().amax(1, keepdim=True) / 127
    assert bool(((quantized.embed_tokens.dequantize() - table).abs() <= step / 2 + 1e-7).all())


def test_clip_false_is_min_max():
    model = random_model(tiny_config(), seed=1)
    quantized = quantize_8da4w(copy.deepcopy(model), clip=False)
    weight = model.layers[0].mlp.up_proj.weight.detach()
    got = quantized.layers[0].mlp.up_proj.weight.dequantize()
    torch.testing.assert_close(got, min_max(weight), rtol=0, atol=0)


BAD = [
    (torch.zeros(2, 8, dtype=torch.long), {}, "1-D"),
    (torch.zeros(0, dtype=torch.long), {}, "non-empty"),
    (torch.rand(8), {}, "token ids"),
    (torch.tensor([0, 64]), {}, r"\[0, 64\)"),
    (torch.tensor([-1, 3]), {}, r"\[0, 64\)"),
    ([1, "2"], {}, "must be ints"),
    ("some text", {}, "token ids"),
    (torch.tensor([1, 2]), {"clip": False}, "clip=False"),
    (None, {"clip": "yes"}, "clip must be True or False"),
    (None, {"int8_embedding": 1}, "int8_embedding must be True or False"),
]


@pytest.mark.parametrize(("calibration", "options", "message"), BAD)
def test_bad_calibration_is_refused_before_the_model_changes(calibration, options, message):
    model = random_model(tiny_config(), seed=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(DiffulexEdgeError, match=message):
        quantize_8da4w(model, calibration=calibration, **options)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_the_package_text_and_a_users_own():
    text = calibration_text()
    assert len(text) > 10_000 and "def " in text and "User:" in text

    def tokenizer(t):
        return {"input_ids": [ord(c) % 64 for c in t]}

    assert calibration_ids(tokenizer).tolist() == [ord(c) % 64 for c in text]
    assert calibration_ids(tokenizer, "abc").tolist() == [ord(c) % 64 for c in "abc"]
    with pytest.raises(DiffulexEdgeError, match="non-empty string"):
        calibration_ids(tokenizer, "  ")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--calibration", "{tmp}/text.txt"], "--calibration is for --quantize"),
        (["--quantize", "8da4w", "--calibration", "{tmp}/none.txt"], "no such file"),
        (["--quantize", "8da4w", "--calibration", "{tmp}/text.txt"], "needs a tokenizer"),
    ],
)
def test_cli_calibration_errors_come_before_any_work(extra, message, tmp_path, capsys):
    (tmp_path / "text.txt").write_text("some calibration text")
    out = tmp_path / "m.pte"
    argv = ["export", "--tiny", "-o", str(out), *(a.replace("{tmp}", str(tmp_path)) for a in extra)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_int8_embedding_returns_its_int8_rows_times_their_scales():
    from diffulex_edge.embedding import Int8Embedding

    table = torch.randn(50, 16) * torch.rand(50, 1) * 3
    table[7] = 0.0  # an all-zero row keeps a finite scale and looks up as zeros
    embedding = Int8Embedding(table)
    assert embedding.weight.dtype == torch.int8 and embedding.scales.shape == (50, 1)
    ids = torch.tensor([[0, 7, 49], [3, 3, 12]])
    got = embedding(ids)
    torch.testing.assert_close(got, embedding.dequantize()[ids], rtol=0, atol=0)
    assert bool((got[0, 1] == 0).all())
    step = table.abs().amax(1, keepdim=True) / 127
    assert bool(((embedding.dequantize() - table).abs() <= step / 2 + 1e-7).all())


def test_quantization_options_without_quantize_are_refused(tmp_path):
    from diffulex_edge.export import export_pte

    model = random_model(tiny_config(), seed=1)
    for options in ({"calibration": [1, 2]}, {"clip": False}, {"int8_embedding": False}):
        with pytest.raises(DiffulexEdgeError, match="options of quantize"):
            export_pte(model, tmp_path / "m.pte", 64, 4, "static_kv", **options)
    assert list(tmp_path.iterdir()) == []
