"""Weights that already lie on a 4-bit grid keep it: 8da4w without rounding them again.

Many checkpoints reach users already quantized once and dequantized to float: a GGUF's
Q4_0 or Q4_1 tensors (SmolLM2 here), a GPTQ or AWQ checkpoint's int4 weights. Each group of
32 inputs then holds at most 16 values, ``offset + step * k`` for integer ``k``. Rounding
such a weight to XNNPACK's int4 grid again (one symmetric scale per group, codes in
[-8, 7], no offset) moves almost every weight, and costs more than the first rounding did.

This module finds those layers and keeps their grids: the group's step becomes the int4
scale, ``k - 8`` the code, and what the symmetric grid cannot hold, the group's offset, is
added back by a second, small product on the group sums of the input::

    W x = (scales * codes) x + offsets @ group_sums(x)

``offsets`` is (out, in / group_size), 1/32 of the weight's entries; it and the group
sums' 0/1 matrix are int8 linear layers (8da8w, one scale per row), so the program holds
about 4.5 bits per weight plus 1/4 bit for the offsets. A layer whose offsets are all zero
(a symmetric grid that fits [-8, 7]) gets no offset product.

XNNPACK stores int4 scales as bfloat16, so the steps are rounded to bfloat16 here and each
group's offset refitted (the mean of what is left), which keeps the eager model's weights
those of the program. What is not exact: the int8 offsets, the int8 dynamic activations
of both products, and a step that bfloat16 does not hold (its relative error, 2^-8 at most,
times the code's distance from the group's mean code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diffulex_edge.errors import DiffulexEdgeError

LEVELS = 16  # int4 codes
ZERO = 8  # grid index k is the code k - ZERO, in [-8, 7]
# A group is on a grid when every weight is within this fraction of a step from it.
TOLERANCE = 1 / 64
# torchao's int8 rows need two inputs: a layer of one group gets a zero second sum.
MIN_SUMS = 2


@dataclass(frozen=True)
class Grid:
    """A layer's weight as int4 codes on bfloat16 steps plus a float offset per group:
    ``weight ~= codes * scales + offsets``, each of ``scales`` and ``offsets`` repeated
    over its group's inputs."""

    codes: torch.Tensor  # (out, in) int8 in [-8, 7]
    scales: torch.Tensor  # (out, in // group_size) float32, bfloat16 values, > 0
    offsets: torch.Tensor  # (out, in // group_size) float32

    def dequantize(self) -> torch.Tensor:
        groups = self.scales.shape[1]
        size = self.codes.shape[1] // groups
        return self.codes.float() * self.scales.repeat_interleave(
            size, 1
        ) + self.offsets.repeat_interleave(size, 1)


@torch.no_grad()
def find_grid(weight: torch.Tensor, group_size: int) -> Grid | None:
    """``weight``'s 4-bit grid, if every group of ``group_size`` inputs lies on one.

    A group is on a grid when its distinct values are ``low + step * k`` for integers
    ``0 <= k < 16``, each within 1/64 of a step: the step is the smallest gap between its
    sorted values (a group of one value has codes 0 and that value as its offset).

    Args:
        weight: (out, in) float; ``in`` divisible by ``group_size``.
        group_size: inputs per group.

    Returns:
        The :class:`Grid`, or None if any group is off every 16-level grid.
    """
    w = weight.detach().float()
    out, width = w.shape
    groups = w.reshape(out, width // group_size, group_size)
    ordered = groups.sort(-1).values
    low, high = ordered[..., 0], ordered[..., -1]
    gaps = ordered.diff(dim=-1)
    tiny = (high - low) * 1e-4  # gaps below this are the same value
    step = torch.where(gaps > tiny[..., None], gaps, torch.inf).amin(-1)
    flat = ~torch.isfinite(step)  # every weight of the group equal
    step = torch.where(flat, torch.ones_like(step), step)
    k = (groups - low[..., None]) / step[..., None]
    index = k.round()
    if bool(((k - index).abs() > TOLERANCE).any()) or bool((index > LEVELS - 1).any()):
        return None
    index = torch.where(flat[..., None], float(ZERO), index)  # code 0, the value its offset
    scales = step.to(torch.bfloat16).float()
    codes = (index - ZERO).to(torch.int8)
    offsets = (groups - codes.float() * scales[..., None]).mean(-1)
    return Grid(codes.reshape(out, width), scales, offsets)


class GroupOffsetLinear(nn.Module):
    """``linear(x) + offset(group_sum(x))``: an int4 linear layer with its groups' offsets
    (:class:`Grid`). ``group_sum`` maps ``in`` inputs to their ``in // group_size`` sums
    (a 0/1 weight, shared by every layer of the same width) and ``offset`` the sums to the
    outputs; both are ordinary linear layers, so any backend that lowers a linear layer
    lowers these."""

    def __init__(self, linear: nn.Module, group_sum: nn.Module, offset: nn.Module) -> None:
        super().__init__()
        self.linear = linear
        self.group_sum = group_sum
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset(self.group_sum(x))


def group_sum_linear(width: int, group_size: int) -> nn.Linear:
    """A linear layer (no bias) whose outputs are the sums of ``width`` inputs in
    contiguous groups of ``group_size``; at least :data:`MIN_SUMS` outputs, the ones past
    the groups zero."""
    groups = width // group_size
    layer = nn.Linear(width, max(groups, MIN_SUMS), bias=False)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[:groups].copy_(torch.eye(groups).repeat_interleave(group_size, 1))
    return layer


def offset_linear(offsets: torch.Tensor) -> nn.Linear:
    """A linear layer (no bias) from group sums to outputs: ``offsets`` (out, groups), its
    inputs padded with zero weights to :data:`MIN_SUMS`."""
    out, groups = offsets.shape
    layer = nn.Linear(max(groups, MIN_SUMS), out, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
        layer.weight[:, :groups].copy_(offsets)
    return layer


@torch.no_grad()
def attach_offsets(model: nn.Module, grids: dict[str, Grid], group_size: int) -> None:
    """Wrap each int4 layer of ``grids`` whose offsets are not all zero in a
    :class:`GroupOffsetLinear`, its group-sum and offset layers int8 (8da8w, one scale per
    row, torchao; the group sums' 0/1 weights are exact in int8). Call after the layers'
    int4 codes and scales are installed.

    Args:
        model: the model that holds the layers, by module name.
        grids: :func:`find_grid`'s results, by module name.
        group_size: inputs per group.
    """
    from torchao.quantization.granularity import PerAxis
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, quantize_

    offsets = {
        fqn: offset_linear(found.offsets) for fqn, found in grids.items() if found.offsets.any()
    }
    if not offsets:
        return
    sums = {
        width: group_sum_linear(width, group_size)
        for width in {grids[fqn].codes.shape[1] for fqn in offsets}
    }
    # One quantize_ over distinct layers: it walks children, and would meet a shared
    # group-sum layer once per user.
    quantize_(
        nn.ModuleList([*sums.values(), *offsets.values()]),
        Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8, weight_granularity=PerAxis(0)
        ),
    )
    for width, layer in sums.items():  # torchao's int8 grid puts 1 at 127 / 127.5: exact it
        ones, weight = group_sum_linear(width, group_size).weight, layer.weight
        weight.qdata.copy_(ones.to(torch.int8))
        weight.scale.fill_(1.0)
        if not torch.equal(weight.dequantize(), ones):
            raise DiffulexEdgeError("torchao's int8 weight does not hold the group sums' 0/1")
    wrapped = {
        fqn: GroupOffsetLinear(model.get_submodule(fqn), sums[grids[fqn].codes.shape[1]], offset)
        for fqn, offset in offsets.items()
    }
    for fqn, module in wrapped.items():
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, module)


__all__ = [
    "Grid",
    "GroupOffsetLinear",
    "attach_offsets",
    "find_grid",
    "group_sum_linear",
    "offset_linear",
]
