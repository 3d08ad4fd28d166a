"""8da4w's calibrated int4 rounding (diffulex_edge.calibration, diffulex_edge.gptq): the
clipping search never rounds a group worse than min-max, torchao rounds a clipped group on
exactly the grid the search scored, GPTQ's codes on the clip's scales change a layer's
output less than rounding to nearest and are exactly what torchao's int4 weights hold, and
bad calibration input is refused before the model changes. The effect on a real model's
perplexity is measured in benchmarks/smollm2_quant_texts.py, not here."""

import copy

import pytest
import torch
from random_sdar import random_model

from diffulex_edge.calibration import (
    CLIP_RATIOS,
    INT4_LEVELS,
    bfloat16_scales,
    calibration_ids,
    calibration_text,
    clip_limits,
    clipped_weight,
    group_covariances,
    int4_grid,
    random_ids,
)
from diffulex_edge.cli import main
from diffulex_edge.config import tiny_config
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.export import MIXED_INT8_LAYERS, quantize_8da4w
from diffulex_edge.gptq import gptq_codes, gptq_int4_layers, install_codes


def output_error(weight, covariance, rounded):
    """Each group's e^T C e, e its rounding error and C its input covariance."""
    error = (rounded - weight).reshape(weight.shape[0], -1, 32)
    return torch.einsum("rgi,gij,rgj->rg", error, covariance, error)


def min_max(weight):
    groups = weight.reshape(weight.shape[0], -1, 32)
    return int4_grid(groups, groups.abs().amax(-1, keepdim=True)).reshape(weight.shape)


def program_grid(groups, limit):
    """int4_grid's codes times their scale rounded to bfloat16: what the program (XNNPACK
    stores int4 scales so) and, since 0.14, the eager model multiply by."""
    scale = (limit / INT4_LEVELS).clamp(min=torch.finfo(groups.dtype).tiny)
    return torch.clamp(torch.round(groups * (1.0 / scale)), -8, 7) * bfloat16_scales(scale)


def program_min_max(weight):
    groups = weight.reshape(weight.shape[0], -1, 32)
    return program_grid(groups, groups.abs().amax(-1, keepdim=True)).reshape(weight.shape)


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
    """Without GPTQ the program is an ordinary 8da4w one: each int4 weight torchao holds
    dequantizes to int4_grid's codes of the clipped weight times their scales in bfloat16
    (as the program holds them), exactly; the int8 layers are not clipped."""
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
        expected[name] = program_grid(groups, groups.abs().amax(-1, keepdim=True)).flatten(1)
    quantized = quantize_8da4w(  # every int4 row int4: the split head is test_split_head's
        copy.deepcopy(model),
        int8_layers=int8_layers,
        calibration=ids,
        gptq=False,
        head_int8_share=0,
    )
    changed = 0
    for name, want in expected.items():
        got = quantized.get_submodule(name).weight.dequantize()
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        changed += not torch.equal(want, program_min_max(model.get_submodule(name).weight.detach()))
    assert changed == len(expected)  # the search moved some group of every layer
    # The tied embedding is int8 per row, not int4: within half a step of its float rows.
    table = model.embed_tokens.weight
    step = table.abs().amax(1, keepdim=True) / 127
    assert bool(((quantized.embed_tokens.dequantize() - table).abs() <= step / 2 + 1e-7).all())


def layer_hessians(model, ids):
    """Each linear layer's E[x x^T] (in, in) float64 over one causal forward of ``ids``."""
    inputs = {}
    hooks = [
        m.register_forward_pre_hook(lambda _m, a, n=n: inputs.setdefault(n, a[0].flatten(0, -2)))
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    n = ids.numel()
    with torch.no_grad():
        model(
            ids[None], torch.arange(n)[None], None, torch.ones(n, n, dtype=torch.bool).tril()[None]
        )
    for hook in hooks:
        hook.remove()
    return {name: x.double().T @ x.double() / n for name, x in inputs.items()}


@pytest.mark.parametrize("seed", [1, 2])
def test_gptq_changes_each_layers_output_less_than_clipping_alone(seed):
    """On the clip's own scales, GPTQ's codes give every layer of a random model a smaller
    output error e^T H e than rounding the clipped weight to nearest (measured: 0.64 to
    0.80 of it per layer, about 0.77 in all)."""
    model = random_model(tiny_config(), seed=seed)
    ids = random_ids(model.config.vocab_size, 256, seed=3)
    errors = {}
    for name, hessian in layer_hessians(model, ids).items():
        weight = model.get_submodule(name).weight.detach()
        groups = weight.shape[1] // 32
        index = torch.arange(groups)
        blocks = hessian.reshape(groups, 32, groups, 32)[index, :, index, :].float()
        limits = clip_limits(weight, blocks, 32)  # (out, groups, 1)
        scales = limits[..., 0] / INT4_LEVELS
        codes = gptq_codes(weight, hessian, scales, 32)
        assert codes.dtype == torch.int8 and int(codes.min()) >= -8 and int(codes.max()) <= 7
        gptq = codes.float() * scales.repeat_interleave(32, 1)
        nearest = int4_grid(weight.reshape(weight.shape[0], groups, 32), limits).flatten(1)
        errors[name] = [
            float(torch.einsum("ri,ij,rj->", e, hessian, e))
            for e in ((nearest - weight).double(), (gptq - weight).double())
        ]
    assert len(errors) == 15  # 7 per decoder layer and the lm_head
    for name, (clip_only, ours) in errors.items():
        assert ours < clip_only, name
    assert sum(e[1] for e in errors.values()) < 0.85 * sum(e[0] for e in errors.values())


@pytest.mark.parametrize("int8_layers", [(), MIXED_INT8_LAYERS])
def test_torchao_holds_exactly_the_gptq_codes(int8_layers):
    """By default each int4 weight torchao holds (and the program runs) dequantizes to
    GPTQ's codes times its groups' scales (bfloat16, as XNNPACK stores them: GPTQ chooses
    the codes on those), exactly, which torchao would not round the same
    weight to by itself; the int8 layers stay torchao's own int8 rounding."""
    model = random_model(tiny_config(), seed=1)
    ids = random_ids(model.config.vocab_size, 96, seed=3)
    reference = copy.deepcopy(model)
    linear = {n: m for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    int4 = {n: m for n, m in linear.items() if n.rsplit(".", 1)[-1] not in int8_layers}
    expected = gptq_int4_layers(reference, int4, ids, 32)
    assert set(expected) == set(int4)
    quantized = quantize_8da4w(
        copy.deepcopy(model), int8_layers=int8_layers, calibration=ids, head_int8_share=0
    )
    for name, (codes, scales) in expected.items():
        assert torch.equal(scales, bfloat16_scales(scales)), name  # codes chosen on these
        weight = quantized.get_submodule(name).weight
        want = codes.float() * scales.repeat_interleave(32, 1)
        torch.testing.assert_close(weight.dequantize(), want, rtol=0, atol=0, msg=name)
        assert not torch.equal(want, min_max(want)), name
    for name in set(linear) - set(int4):
        float_weight = model.get_submodule(name).weight.detach()
        step = float_weight.abs().amax(1, keepdim=True) / 127
        error = quantized.get_submodule(name).weight.dequantize() - float_weight
        assert bool((error.abs() <= step / 2 + 1e-7).all()), name


def test_codes_go_only_into_the_int4_weights_torchao_made():
    """A weight torchao did not make (here a float lm_head) is refused before any layer's
    codes are written; a layer outside the decoder layers and lm_head before any rounding."""
    model = random_model(tiny_config(), seed=1)
    ids = random_ids(model.config.vocab_size, 96, seed=3)
    reference = copy.deepcopy(model)
    int4 = {n: m for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}
    results = gptq_int4_layers(reference, int4, ids, 32)
    quantized = quantize_8da4w(copy.deepcopy(model), clip=False)
    quantized.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    before = {n: quantized.get_submodule(n).weight.dequantize() for n in results if n != "lm_head"}
    with pytest.raises(DiffulexEdgeError, match="lm_head: torchao's int4 weight is not"):
        install_codes(quantized, results)
    for name, weight in before.items():
        assert torch.equal(quantized.get_submodule(name).weight.dequantize(), weight), name
    with pytest.raises(DiffulexEdgeError, match=r"not \['extra'\]"):
        gptq_int4_layers(reference, {"extra": torch.nn.Linear(32, 8)}, ids, 32)


@pytest.mark.parametrize(
    ("shapes", "damp", "message"),
    [
        (((4, 64), (32, 32), (4, 2)), 0.1, "hessian must be"),
        (((4, 48), (48, 48), (4, 1)), 0.1, "multiple of group_size"),
        (((4, 64), (64, 64), (4, 1)), 0.1, "scales must be"),
        (((4, 64), (64, 64), (4, 2)), 0.0, "damp must be"),
    ],
)
def test_gptq_codes_refuses_what_does_not_fit(shapes, damp, message):
    weight, hessian, scales = (torch.rand(*shape) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        gptq_codes(weight, hessian, scales, 32, damp=damp)


def test_clip_false_is_min_max():
    model = random_model(tiny_config(), seed=1)
    quantized = quantize_8da4w(copy.deepcopy(model), clip=False)
    weight = model.layers[0].mlp.up_proj.weight.detach()
    got = quantized.layers[0].mlp.up_proj.weight.dequantize()
    torch.testing.assert_close(got, program_min_max(weight), rtol=0, atol=0)


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
    (None, {"gptq": 1}, "gptq must be True, False or None"),
    (None, {"clip": False, "gptq": True}, "needs clip=True"),
    (None, {"grid": 1}, "grid must be True, False or a tuple"),
    (None, {"head_int8_share": 1.0}, r"head_int8_share must be in \[0, 1\)"),
    (None, {"head_int8_share": -0.1}, r"head_int8_share must be in \[0, 1\)"),
    (None, {"head_int8_share": True}, r"head_int8_share must be in \[0, 1\)"),
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
        (["--no-grid"], "--no-grid and --grid are for --quantize"),
        (["--grid", "all"], "--no-grid and --grid are for --quantize"),
        (
            ["--quantize", "8da4w", "--no-grid", "--grid", "all"],
            "--no-grid and --grid exclude each other",
        ),
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
    for options in (
        {"calibration": [1, 2]},
        {"clip": False},
        {"int8_embedding": False},
        {"gptq": False},
        {"grid": False},
        {"head_int8_share": 0},
    ):
        with pytest.raises(DiffulexEdgeError, match="options of quantize"):
            export_pte(model, tmp_path / "m.pte", 64, 4, "static_kv", **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "grid"),
    [
        ([], None),
        (["--no-grid"], False),
        (["--grid", "all"], True),
        (["--grid", "down_proj, o_proj"], ("down_proj", "o_proj")),
    ],
)
def test_cli_no_grid_reaches_the_export(extra, grid, tmp_path, monkeypatch, capsys):
    import diffulex_edge.export as export_module

    seen = {}

    def export_pte(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped before exporting")

    monkeypatch.setattr(export_module, "export_pte", export_pte)
    argv = ["export", "--tiny", "-o", str(tmp_path / "m.pte"), "--quantize", "8da4w", *extra]
    assert main(argv) == 2
    assert "stopped before exporting" in capsys.readouterr().err
    assert seen.get("grid") == grid
