"""Layers already on a 4-bit grid keep it (diffulex_edge.grid): a Q4_1-style weight (what
a GGUF holds) is found and kept to within bfloat16's step and the int8 offsets, a weight off
every 16-level grid is not, quantize_8da4w keeps the grid layers' codes and steps exactly
(by default those of GRID_LAYERS' kinds; grid=True: all) and leaves the others as GPTQ
rounds them, and the exported program runs what the eager model runs. SmolLM2's perplexity
is measured in benchmarks/smollm2_quality.py."""

import copy

import pytest
import torch
from random_sdar import random_model
from torch import nn

from diffulex_edge import EagerDynamic
from diffulex_edge.calibration import random_ids
from diffulex_edge.config import tiny_config
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.export import GRID_LAYERS, quantize_8da4w
from diffulex_edge.grid import ZERO, GroupOffsetLinear, find_grid


def q4_1(weight: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """``weight`` rounded as llama.cpp's Q4_1 rounds it, dequantized: per group, a float16
    step (max - min) / 15 and a float16 minimum, codes 0..15."""
    out, width = weight.shape
    groups = weight.reshape(out, width // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = ((high - low) / 15).clamp(min=1e-8).half().float()
    low = low.half().float()
    codes = ((groups - low) / step).round().clamp(0, 15)
    return (codes * step + low).reshape(out, width)


def snapped(model):
    """``model`` with every linear weight on a Q4_1 grid (the embedding left as it is)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(q4_1(module.weight))
    return model


def effective_weight(module) -> torch.Tensor:
    """What a quantized layer multiplies its input by: int4 codes times steps, plus the
    offsets spread over their groups (through the group-sum layer's 0/1 weight)."""
    if not isinstance(module, GroupOffsetLinear):
        return module.weight.dequantize()
    return (
        module.linear.weight.dequantize()
        + module.offset.weight.dequantize() @ module.group_sum.weight.dequantize()
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_q4_1_weight_is_found_and_kept(seed):
    generator = torch.Generator().manual_seed(seed)
    weight = q4_1(torch.randn(24, 128, generator=generator) * 0.05)
    grid = find_grid(weight, 32)
    assert grid is not None
    assert grid.codes.dtype == torch.int8
    assert int(grid.codes.min()) >= -8 and int(grid.codes.max()) <= 7
    assert torch.equal(grid.scales, grid.scales.to(torch.bfloat16).float())
    # bfloat16's step is off by 2^-8 of it at most, times a code's distance from the mean
    bound = (grid.scales * 2**-8 * 16).repeat_interleave(32, 1) + 1e-7
    assert bool(((grid.dequantize() - weight).abs() <= bound).all())


def test_a_step_bfloat16_holds_is_kept_exactly():
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(3))
    step = torch.tensor([2.0**-7, 3 * 2.0**-9]).repeat(8, 1)
    low = torch.linspace(-0.1, 0.05, 16).reshape(8, 2)
    weight = codes.float() * step.repeat_interleave(32, 1) + low.repeat_interleave(32, 1)
    grid = find_grid(weight, 32)
    assert grid is not None
    torch.testing.assert_close(grid.dequantize(), weight, rtol=0, atol=1e-7)


def test_weights_off_every_16_level_grid_are_not_found():
    generator = torch.Generator().manual_seed(4)
    assert find_grid(torch.randn(8, 64, generator=generator), 32) is None
    on = q4_1(torch.randn(8, 64, generator=generator))
    assert find_grid(on, 32) is not None
    nudged = on.clone()
    groups = nudged.reshape(8, 2, 32)
    step = (groups[0, 0].max() - groups[0, 0].min()) / 15
    nudged[0, 5] += 0.1 * step  # a tenth of a step off the grid
    assert find_grid(nudged, 32) is None
    seventeen = torch.arange(64.0).remainder(17).reshape(1, 64) * 0.01  # 17 levels in a group
    assert find_grid(seventeen, 32) is None


def test_a_group_of_one_value_is_its_offset():
    weight = torch.zeros(2, 64)
    weight[1, 32:] = 0.25
    grid = find_grid(weight, 32)
    assert grid is not None
    assert bool((grid.codes == 0).all())
    assert torch.equal(grid.offsets, torch.tensor([[0.0, 0.0], [0.0, 0.25]]))
    assert torch.equal(grid.dequantize(), weight)
    assert ZERO == 8


def test_quantize_keeps_every_grid_layer_and_rounds_the_rest():
    """A model whose linear layers are on a grid: each keeps its codes and steps exactly and
    its offsets to int8's step; the program's layers are wrapped, their int4 weights the
    grid's. With grid=False (and every lm_head row int4) the same layers are GPTQ's,
    further from the float weights."""
    model = snapped(random_model(tiny_config(), seed=1))
    ids = random_ids(model.config.vocab_size, 96, seed=3)
    kept = quantize_8da4w(copy.deepcopy(model), calibration=ids, grid=True)
    rounded = quantize_8da4w(copy.deepcopy(model), calibration=ids, grid=False, head_int8_share=0)
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for name in linear:
        weight = model.get_submodule(name).weight.detach()
        grid = find_grid(weight, 32)
        module = kept.get_submodule(name)
        assert isinstance(module, GroupOffsetLinear) == bool(grid.offsets.any()), name
        int4 = module.linear if isinstance(module, GroupOffsetLinear) else module
        want = grid.codes.float() * grid.scales.repeat_interleave(32, 1)
        torch.testing.assert_close(int4.weight.dequantize(), want, rtol=0, atol=0, msg=name)
        ours = (effective_weight(module) - weight).abs().max()
        theirs = (rounded.get_submodule(name).weight.dequantize() - weight).abs().max()
        offset_step = grid.offsets.abs().amax() / 127
        assert ours <= offset_step / 2 * 1.01 + grid.scales.max() * 2**-8 * 16, name
        assert ours < theirs / 4, name
    x = torch.randint(0, model.config.vocab_size - 2, (1, 24), generator=torch.Generator())
    with torch.no_grad():
        logits = {
            key: EagerDynamic(m, 1).prefill_causal(x, all_logits=True)
            for key, m in (("float", model), ("kept", kept), ("rounded", rounded))
        }
    error = (logits["kept"] - logits["float"]).abs().mean()
    assert error < (logits["rounded"] - logits["float"]).abs().mean() / 2


def _dequantized(model) -> dict[str, torch.Tensor]:
    return {
        name: value.dequantize() if hasattr(value, "dequantize") else value
        for name, value in model.state_dict().items()
    }


@pytest.mark.parametrize("grid", ["default", ("down_proj",), ["q_proj", "up_proj"]])
def test_only_the_named_kinds_keep_their_grid(grid):
    """By default the layers of GRID_LAYERS' kinds keep their grid and every other layer is
    exactly what grid=False makes of it (GPTQ's Hessians come from the float model, so one
    layer's choice does not move another's codes); a tuple or list names its own kinds."""
    model = snapped(random_model(tiny_config(), seed=1))
    ids = random_ids(model.config.vocab_size, 96, seed=3)
    kinds = GRID_LAYERS if grid == "default" else tuple(grid)
    options = {} if grid == "default" else {"grid": grid}
    chosen = _dequantized(quantize_8da4w(copy.deepcopy(model), calibration=ids, **options))
    every = _dequantized(quantize_8da4w(copy.deepcopy(model), calibration=ids, grid=True))
    none = _dequantized(quantize_8da4w(copy.deepcopy(model), calibration=ids, grid=False))
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    wrapped = set()
    for name, value in chosen.items():
        kind = next((part for part in name.split(".") if part in linear), None)
        want = every if kind in kinds else none
        assert torch.equal(value, want[name]), name
        if name.endswith(".offset.weight"):
            wrapped.add(kind)
    assert wrapped == set(kinds)


def test_off_grid_layers_are_what_grid_false_makes():
    model = random_model(tiny_config(), seed=2)
    ids = random_ids(model.config.vocab_size, 96, seed=3)
    kept = quantize_8da4w(copy.deepcopy(model), calibration=ids)
    rounded = quantize_8da4w(copy.deepcopy(model), calibration=ids, grid=False)
    assert not any(isinstance(m, GroupOffsetLinear) for m in kept.modules())
    ours, theirs = _dequantized(kept), _dequantized(rounded)
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name


@pytest.mark.parametrize(
    ("grid", "error", "message"),
    [
        ("yes", DiffulexEdgeError, "grid must be True, False or a tuple of linear layer names"),
        (1, DiffulexEdgeError, "grid must be True, False or a tuple"),
        (("down_proj", 3), DiffulexEdgeError, "grid must be True, False or a tuple"),
        (("down_proj", "mlp"), ValueError, r"grid \['mlp'\] name no linear layer"),
    ],
)
def test_grid_is_checked_first(grid, error, message):
    model = snapped(random_model(tiny_config(), seed=1))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=message):
        quantize_8da4w(model, grid=grid)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_grid_8da4w_pte_matches_its_eager_model(tmp_path):
    """The program runs the default quantization as the eager model does, the wrapped
    layers and GPTQ's alike: same greedy tokens and logits within float reordering of the
    int8 products. (Before 0.14 GPTQ's scales were float32 in the eager model and bfloat16
    in the program: logits 0.036 apart here.)"""
    from diffulex_edge import PteEngine, export_pte

    model = snapped(random_model(tiny_config(), seed=1))
    ids = random_ids(model.config.vocab_size, 96, seed=3)
    result = export_pte(model, tmp_path / "m.pte", 64, 1, "static_kv", "8da4w", calibration=ids)
    eager = quantize_8da4w(copy.deepcopy(model), calibration=ids)
    assert any(isinstance(m, GroupOffsetLinear) for m in eager.modules())
    engine = PteEngine(result.path, expected_config=model.config)
    prompt = torch.randint(0, model.config.vocab_size - 2, (1, 12), generator=torch.Generator())
    engine.backend.reset()
    got = engine.backend.prefill_causal(prompt, all_logits=True)
    want = EagerDynamic(eager, 1).prefill_causal(prompt, all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
