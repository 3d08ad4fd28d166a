"""Calibrated int4 weights for 8da4w: each group's clipping range chosen on text.

XNNPACK runs int4 weights symmetric, in groups of 32 along the input, with one scale per
group: the quantizer maps a group's largest |w| to the edge of the grid. A few large weights
then make the grid coarse for all the others. Clipping each group to ``ratio * max|w|``
first, with the ratio that gives the least error, trades a little error on those weights
for less on the rest. The error is the layer's output error on calibration text, e^T C e for
a group's rounding error e and the covariance C of the group's inputs (as AWQ's clipping
search measures it on sampled outputs), so the channels that carry large or correlated
activations keep their precision. On SmolLM2, measured on the three held-out texts of
``benchmarks/smollm2_quant_texts.py``, the covariance chose better clips than its diagonal
alone (each channel's mean squared activation) for 8da4w-mixed on all three texts and for
8da4w on two (chat: 1.229x against 1.202x fp32's perplexity).

A clipped group is still min-max to the quantizer: its largest |w| is the clip, so
torchao's grid is the clipped one and the program is an ordinary 8da4w program. By default
``quantize_8da4w`` keeps only the clip's scale and has GPTQ choose the codes
(:mod:`diffulex_edge.gptq`); ``gptq=False`` rounds the clipped group to nearest, as here.

The package's calibration text (``calibration.txt``, written for membound, and
diffulex-edge's own MIT source) needs the model's tokenizer: :func:`calibration_ids`.
Without text, :func:`random_ids` gives token ids drawn uniformly from the vocabulary:
they find the channels with large activations less well (measured on SmolLM2-135M in
``benchmarks/smollm2_quant_texts.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.resources import files

import torch
from torch import nn

from diffulex_edge.errors import DiffulexEdgeError

# Clipping ratios searched per group, 0.50, 0.52, ..., 1.00 (1.00 is min-max).
CLIP_RATIOS = tuple(round(0.5 + 0.02 * i, 2) for i in range(26))
WINDOW = 512  # calibration tokens per causal forward
RANDOM_TOKENS = 2048  # token ids random_ids draws by default
INT4_LEVELS = 7.5  # symmetric int4: a group's scale is its max |w| / 7.5, codes in [-8, 7]


def calibration_text() -> str:
    """The package's calibration text: English prose, a chat transcript and Python source
    (about 3,600 SmolLM2 tokens).

    Returns:
        The text.
    """
    return files("diffulex_edge").joinpath("calibration.txt").read_text(encoding="utf-8")


def calibration_ids(tokenizer: Callable, text: str | None = None) -> torch.Tensor:
    """Token ids of ``text`` (default: :func:`calibration_text`) for ``quantize_8da4w``.

    Args:
        tokenizer: the model's Hugging Face tokenizer (called as ``tokenizer(text)``,
            returning ``input_ids``).
        text: the user's own calibration text; None for the package's.

    Returns:
        A 1-D int64 tensor of token ids.

    Raises:
        DiffulexEdgeError: ``text`` is not a non-empty string.
    """
    if text is None:
        text = calibration_text()
    if not isinstance(text, str) or not text.strip():
        raise DiffulexEdgeError(f"calibration text must be a non-empty string, got {text!r:.60}")
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def random_ids(vocab_size: int, n: int = RANDOM_TOKENS, seed: int = 0) -> torch.Tensor:
    """``n`` token ids drawn uniformly from ``[0, vocab_size)`` (a fixed seed): calibration
    when no text is at hand.

    Args:
        vocab_size: the model's vocabulary size.
        n: how many ids.
        seed: the generator's seed.

    Returns:
        A 1-D int64 tensor.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=generator)


def check_ids(ids, vocab_size: int) -> torch.Tensor:
    """``ids`` as a 1-D int64 tensor, checked against the vocabulary.

    Args:
        ids: token ids, a 1-D integer tensor or a sequence of ints.
        vocab_size: the model's vocabulary size.

    Returns:
        The ids as a 1-D int64 tensor.

    Raises:
        DiffulexEdgeError: ids that are empty, not 1-D, not integers, or outside the vocabulary.
    """
    if isinstance(ids, Sequence) and not isinstance(ids, str | bytes):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise DiffulexEdgeError("calibration ids must be ints")
        ids = torch.tensor(list(ids), dtype=torch.long)
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise DiffulexEdgeError(
            f"calibration must be token ids (a 1-D integer tensor or a list of ints), got {ids!r:.60}"
        )
    if ids.dim() != 1 or ids.numel() == 0:
        raise DiffulexEdgeError(
            f"calibration ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}"
        )
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise DiffulexEdgeError(
            f"calibration ids must lie in [0, {vocab_size}) (the model's vocabulary), "
            f"got {low}..{high}"
        )
    return ids.long()


def causal_windows(model: nn.Module, ids: torch.Tensor):
    """``ids`` as the model's arguments for causal forwards of ``WINDOW`` tokens (or the
    model's ``max_position_embeddings``, if fewer): (ids (1, T), positions (1, T), no cache,
    causal mask (1, T, T)) per window."""
    window = min(WINDOW, model.config.max_position_embeddings)
    for start in range(0, ids.numel(), window):
        chunk = ids[start : start + window][None]
        n = chunk.shape[1]
        yield chunk, torch.arange(n)[None], None, torch.ones(n, n, dtype=torch.bool).tril()[None]


@torch.no_grad()
def group_covariances(
    model: nn.Module, ids: torch.Tensor, layers: dict[str, nn.Linear], group_size: int
) -> dict[str, torch.Tensor]:
    """Each layer's input covariance within each group of ``group_size`` input channels,
    E[x_g x_g^T] over causal forwards of ``ids``: the blocks on the diagonal of E[x x^T].

    Args:
        model: an :class:`~diffulex_edge.model.SDARModel`.
        ids: checked calibration ids (:func:`check_ids`), run in windows of ``WINDOW``
            tokens (or the model's ``max_position_embeddings``, if fewer).
        layers: the linear layers to measure, by module name.
        group_size: input channels per group; divides every layer's ``in_features``.

    Returns:
        ``{name: (in_features // group_size, group_size, group_size) float32}``.
    """
    sums = {
        name: torch.zeros(m.in_features // group_size, group_size, group_size, dtype=torch.float64)
        for name, m in layers.items()
    }

    def record(name):
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            x = x.reshape(x.shape[0], -1, group_size)
            sums[name] += torch.einsum("ngi,ngj->gij", x, x)

        return hook

    hooks = [m.register_forward_pre_hook(record(name)) for name, m in layers.items()]
    try:
        for window in causal_windows(model, ids):
            model(*window)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: (s / ids.numel()).float() for name, s in sums.items()}


def int4_grid(groups: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``groups`` (..., group) rounded to the symmetric int4 grid whose edge is ``limit``
    (..., 1): scale ``limit / 7.5``, codes clamped to [-8, 7], rounded as torchao's
    ``quantize_affine`` rounds them (times the reciprocal of the scale: at a clipped edge,
    -7.5 can round either way)."""
    scale = (limit / INT4_LEVELS).clamp(min=torch.finfo(groups.dtype).tiny)
    return torch.clamp(torch.round(groups * (1.0 / scale)), -8, 7) * scale


@torch.no_grad()
def clip_limits(weight: torch.Tensor, covariance: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each int4 group's clipping limit: ``ratio * max|w|`` for the ratio of
    :data:`CLIP_RATIOS` whose int4 rounding changes the layer's output least on the
    calibration inputs: for a group's rounding error e, e^T C e, C the group's input
    covariance (:func:`group_covariances`).

    Args:
        weight: (out, in) float, a linear layer's weight, ``in`` divisible by ``group_size``.
        covariance: (in // group_size, group_size, group_size) float input covariances.
        group_size: inputs per int4 group.

    Returns:
        (out, in // group_size, 1) float32 limits: a group's scale is its limit / 7.5.
    """
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    amax = groups.abs().amax(-1, keepdim=True)
    covariance = covariance.float()
    best_err = best = None
    for ratio in CLIP_RATIOS:
        # Scored as it will be rounded: clipped first, then on the grid of the clip.
        limit = amax * ratio
        clipped = torch.maximum(torch.minimum(groups, limit), -limit)
        error = int4_grid(clipped, limit) - groups
        err = torch.einsum("rgi,gij,rgj->rg", error, covariance, error)[..., None]
        if best_err is None:
            best_err, best = err, limit
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, limit, best)
    return best


@torch.no_grad()
def clipped_weight(weight: torch.Tensor, covariance: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` (out, in) with each group of ``group_size`` inputs clipped to its
    :func:`clip_limits` limit.

    Args:
        weight: a linear layer's weight, ``in`` divisible by ``group_size``.
        covariance: (in // group_size, group_size, group_size) input covariances.
        group_size: inputs per int4 group.

    Returns:
        A new (out, in) tensor, clipped (not rounded): torchao rounds it.
    """
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    limit = clip_limits(weight, covariance, group_size)
    clipped = torch.maximum(torch.minimum(groups, limit), -limit)
    return clipped.reshape(rows, cols).to(weight.dtype)


def untie_weight(model: nn.Module, module: nn.Linear) -> None:
    """Give ``module`` its own copy of the embedding table if it shares it (a tied
    ``lm_head``), so that rounding it leaves the embedding's float weights alone."""
    embed = getattr(model, "embed_tokens", None)
    if embed is not None and module.weight is embed.weight:
        module.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=False)


def bfloat16_scales(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` rounded to bfloat16 (to nearest even), back in their dtype: XNNPACK stores
    an int4 group's scale so, and an eager model whose scales are not rounded the same way
    is not the program (its logits moved by up to 0.036 on a tiny model, 0.14)."""
    return scales.to(torch.bfloat16).to(scales.dtype)


@torch.no_grad()
def round_int4_scales(model: nn.Module, names) -> None:
    """Round the int4 scales of torchao's weights at ``names`` (module names) to bfloat16 in
    place (:func:`bfloat16_scales`), so that the eager model runs what the program runs."""
    for name in names:
        scale = model.get_submodule(name).weight.scale
        scale.copy_(bfloat16_scales(scale))


@torch.no_grad()
def clip_int4_layers(
    model: nn.Module, layers: dict[str, nn.Linear], ids: torch.Tensor, group_size: int
) -> None:
    """Clip the weights of ``layers`` in place for int4 (:func:`clipped_weight`), with the
    input covariances of ``model`` on ``ids``. An ``lm_head`` tied to the embedding is untied first
    (the embedding keeps its float weights).

    Args:
        model: the :class:`~diffulex_edge.model.SDARModel` that holds ``layers``.
        layers: the linear layers that will be int4, by module name.
        ids: checked calibration ids.
        group_size: inputs per int4 group.
    """
    covariances = group_covariances(model, ids, layers, group_size)
    for name, module in layers.items():
        untie_weight(model, module)
        module.weight.copy_(clipped_weight(module.weight, covariances[name], group_size))


__all__ = [
    "CLIP_RATIOS",
    "bfloat16_scales",
    "calibration_ids",
    "calibration_text",
    "causal_windows",
    "check_ids",
    "clip_int4_layers",
    "clip_limits",
    "clipped_weight",
    "group_covariances",
    "random_ids",
    "round_int4_scales",
    "untie_weight",
]
