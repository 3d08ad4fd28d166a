"""GPTQ rounding for 8da4w's int4 groups (Frantar et al., "GPTQ", ICLR 2023).

Rounding each weight to its nearest code ignores that the layer's inputs are correlated:
GPTQ rounds one input column at a time and moves the weights not yet rounded to cancel the
error so far, by the inverse of the layer's input Hessian H = E[x x^T] on calibration
text, which keeps the layer's output error e^T H e small rather than each weight's.

The grid stays the one XNNPACK runs: groups of 32 contiguous inputs, one symmetric scale
each. Each group's scale is fixed first, by the clipping search of
:mod:`diffulex_edge.calibration` on H's diagonal blocks; GPTQ then only chooses the codes.
Columns are rounded in order of decreasing E[x_i^2] (GPTQ's "act-order" with static groups:
the permutation changes the order of rounding, not which inputs share a scale), so the
inputs that carry the most are rounded first and the others compensate for them.

H is collected one decoder layer at a time, on the float model's inputs to it, so only
one layer's H is held at a time. (Collecting each layer's H through the layers already
rounded, GPTQ's sequential variant, fit SmolLM2 no better.)

torchao takes a group's scale from the weight it is given (max |w| / 7.5), which GPTQ's
codes need not reach, so :func:`install_codes` writes the codes and scales into the int4
tensors torchao made and checks that each dequantizes to exactly codes * scales.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from diffulex_edge.calibration import (
    INT4_LEVELS,
    bfloat16_scales,
    causal_windows,
    clip_limits,
    untie_weight,
)
from diffulex_edge.errors import DiffulexEdgeError

# Added to H's diagonal, times its mean. On SmolLM2, of 0.01 to 1, 0.05 and 0.1 fit best:
# 3,600 tokens of calibration text pin H down less than GPTQ's usual 0.01 assumes.
DAMP = 0.05
BLOCK = 128  # columns per lazy batch update (GPTQ's): the same result, fewer passes over W


@torch.no_grad()
def gptq_codes(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    damp: float = DAMP,
) -> torch.Tensor:
    """Int4 codes for ``weight`` on fixed group scales, by GPTQ with act-order.

    Args:
        weight: (out, in) float, a linear layer's weight.
        hessian: (in, in) float, E[x x^T] of the layer's inputs.
        scales: (out, in // group_size) float, each group's scale (> 0).
        group_size: inputs per group, contiguous.
        damp: added to the diagonal of ``hessian``, times its mean.

    Returns:
        (out, in) int8 codes in [-8, 7]: the rounded weight is codes times the group's scale.

    Raises:
        ValueError: shapes that do not fit, or ``damp`` not positive.
    """
    rows, cols = weight.shape
    if hessian.shape != (cols, cols) or cols % group_size:
        raise ValueError(
            f"hessian must be ({cols}, {cols}) and {cols} a multiple of group_size "
            f"{group_size}; got {tuple(hessian.shape)}"
        )
    if scales.shape != (rows, cols // group_size):
        raise ValueError(
            f"scales must be ({rows}, {cols // group_size}), got {tuple(scales.shape)}"
        )
    if not damp > 0:
        raise ValueError(f"damp must be > 0, got {damp}")
    order = torch.argsort(torch.diagonal(hessian), descending=True, stable=True)
    h = hessian.double()[order][:, order]
    dead = torch.diagonal(h) == 0  # inputs never seen: rounded to nearest, compensate nothing
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * h.diagonal().mean())
    # Upper Cholesky factor of H^-1: row i holds how column i's error spreads to the rest.
    inverse = torch.linalg.cholesky(
        torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True
    ).float()
    w = weight.detach().float()[:, order]  # (out, in), permuted: a copy we update
    step = scales.float().repeat_interleave(group_size, 1)[:, order]  # (out, in)
    codes = torch.empty(rows, cols, dtype=torch.int8)
    for start in range(0, cols, BLOCK):
        end = min(start + BLOCK, cols)
        block = w[:, start:end]  # (out, <= BLOCK), a view: updated in place
        errors = torch.empty_like(block)
        for i in range(end - start):
            j = start + i
            code = torch.clamp(torch.round(block[:, i] / step[:, j]), -8, 7)
            codes[:, j] = code.to(torch.int8)
            error = (block[:, i] - code * step[:, j]) / inverse[j, j]
            block[:, i:] -= error[:, None] * inverse[j, j:end][None]
            errors[:, i] = error
        w[:, end:] -= errors @ inverse[start:end, end:]
    unpermuted = torch.empty_like(codes)
    unpermuted[:, order] = codes
    return unpermuted


class _Captured(Exception):
    """Raised by the last decoder layer's hook: the forward has what it needs."""


def _decoder_inputs(model: nn.Module, ids: torch.Tensor) -> tuple[list, list[list]]:
    """The first decoder layer's hidden states per calibration window, and each layer's
    other arguments (RoPE tables, empty caches, mask) per window."""
    hidden, args = [], [[] for _ in model.layers]

    def capture(i):
        def hook(_module, layer_args):
            if i == 0:
                hidden.append(layer_args[0])
            args[i].append(layer_args[1:])
            if i == len(model.layers) - 1:
                raise _Captured

        return hook

    hooks = [layer.register_forward_pre_hook(capture(i)) for i, layer in enumerate(model.layers)]
    try:
        for window in causal_windows(model, ids):
            with contextlib.suppress(_Captured):
                model(*window)
    finally:
        for hook in hooks:
            hook.remove()
    return hidden, args


def _round(module: nn.Linear, hessian: torch.Tensor, group_size: int):
    """``module``'s codes and scales: the clipping search's scales (on H's diagonal
    blocks), GPTQ's codes."""
    weight = module.weight.detach().float()
    groups = weight.shape[1] // group_size
    index = torch.arange(groups)
    blocks = hessian.reshape(groups, group_size, groups, group_size)[index, :, index, :]
    limits = clip_limits(weight, blocks.float(), group_size)  # (out, groups, 1)
    scales = (limits[..., 0] / INT4_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    scales = bfloat16_scales(scales)  # the program's: codes are chosen on what it runs
    return gptq_codes(weight, hessian, scales, group_size), scales


@torch.no_grad()
def gptq_int4_layers(
    model: nn.Module, layers: dict[str, nn.Linear], ids: torch.Tensor, group_size: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Int4 codes and scales of ``layers`` by GPTQ (:func:`gptq_codes`) on the scales of
    the clipping search, each layer's H = E[x x^T] from causal forwards of ``ids``. The
    model's weights are left as they are, but for an ``lm_head`` tied to the embedding,
    which is untied (the embedding keeps its weights).

    Args:
        model: the :class:`~diffulex_edge.model.SDARModel` that holds ``layers``.
        layers: the linear layers that will be int4, by module name.
        ids: checked calibration ids (:func:`~diffulex_edge.calibration.check_ids`).
        group_size: inputs per int4 group; divides every layer's ``in_features``.

    Returns:
        ``{name: (codes (out, in) int8, scales (out, in // group_size) float32)}`` for
        every layer of ``layers``, for :func:`install_codes`.

    Raises:
        DiffulexEdgeError: a layer of ``layers`` that is neither in a decoder layer nor the
            ``lm_head`` (before anything changes).
    """
    roundable = {m for layer in model.layers for m in layer.modules()} | {model.lm_head}
    outside = sorted(name for name, module in layers.items() if module not in roundable)
    if outside:
        raise DiffulexEdgeError(f"GPTQ rounds decoder layers and lm_head only, not {outside}")
    names = {module: name for name, module in layers.items()}
    if model.lm_head in names:
        untie_weight(model, model.lm_head)
    hidden, args = _decoder_inputs(model, ids)
    results, sums = {}, {}

    def accumulate(module, inputs):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()  # (T, in)
        sums[module] += x.T @ x

    for layer, layer_args in zip(model.layers, args, strict=True):
        todo = [m for m in layer.modules() if m in names]
        sums.update(
            {m: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for m in todo}
        )
        hooks = [m.register_forward_pre_hook(accumulate) for m in todo]
        try:
            hidden = [layer(h, *rest)[0] for h, rest in zip(hidden, layer_args, strict=True)]
        finally:
            for hook in hooks:
                hook.remove()
        for m in todo:
            results[names[m]] = _round(m, sums.pop(m) / ids.numel(), group_size)
    if model.lm_head in names:
        x = torch.cat([model.norm(h).reshape(-1, h.shape[-1]) for h in hidden]).double()
        results[names[model.lm_head]] = _round(model.lm_head, x.T @ x / ids.numel(), group_size)
    return results


@torch.no_grad()
def install_codes(model: nn.Module, results: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write each layer's codes and scales into the int4 weight torchao made of it
    (``IntxUnpackedToInt8Tensor``: ``qdata``, ``scale``, ``zero_point``).

    Args:
        model: the model after torchao's int4 ``quantize_``.
        results: :func:`gptq_int4_layers`'s.

    Raises:
        DiffulexEdgeError: a weight not in that form (another torchao; checked for all
            before any is written), or one that does not dequantize to exactly
            codes * scales after the write.
    """
    targets = {}
    for name, (codes, scales) in results.items():  # all checked before any is written
        weight = model.get_submodule(name).weight
        parts = [getattr(weight, part, None) for part in ("qdata", "scale", "zero_point")]
        if (
            any(not isinstance(p, torch.Tensor) for p in parts)
            or parts[0].shape != codes.shape
            or parts[1].shape != scales.shape
            or bool((parts[2] != 0).any())
        ):
            raise DiffulexEdgeError(
                f"{name}: torchao's int4 weight is not the (qdata {tuple(codes.shape)}, scale "
                f"{tuple(scales.shape)}, zero point 0) this version of diffulex-edge writes"
            )
        targets[name] = weight, parts
    for name, (weight, (qdata, scale, _)) in targets.items():
        codes, scales = results[name]
        qdata.copy_(codes)
        scale.copy_(scales)
        want = codes.float() * scales.repeat_interleave(codes.shape[1] // scales.shape[1], 1)
        if not torch.equal(weight.dequantize(), want.to(weight.dtype)):
            raise DiffulexEdgeError(f"{name}: torchao's int4 weight does not hold the GPTQ codes")


__all__ = ["DAMP", "gptq_codes", "gptq_int4_layers", "install_codes"]
