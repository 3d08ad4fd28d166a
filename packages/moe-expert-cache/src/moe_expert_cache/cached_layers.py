"""The expert projections over stacked resident tensors, addressed by local slot: mlx-lm's
own ``SwitchLinear`` / ``QuantizedSwitchLinear`` holding ``capacity`` experts."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from moe_expert_cache.errors import ExpertCacheError


def check_projection(stock: nn.Module, params) -> bool:
    """Whether ``stock`` is a quantized projection whose checkpoint tensors ``params``
    (names: weight, scales, biases, bias) we can serve; raises when we cannot."""
    if isinstance(stock, QuantizedSwitchLinear):
        if stock.global_scale is not None:
            raise ExpertCacheError(
                "experts quantized with a global scale (nvfp4) are not supported"
            )
        quantized = True
    elif isinstance(stock, SwitchLinear):
        quantized = False
    else:
        raise ExpertCacheError(f"expected SwitchLinear or QuantizedSwitchLinear, got {type(stock)}")
    if quantized != ("scales" in params):
        kind = "quantized" if quantized else "float"
        raise ExpertCacheError(
            f"the checkpoint's expert tensors {sorted(params)} do not match a {kind} projection"
        )
    return quantized


def cut_to_slots(stock: nn.Module, slot_rows: dict[str, list[mx.array]]) -> nn.Module:
    """Make the stock ``SwitchLinear`` / ``QuantizedSwitchLinear`` ``stock`` hold only the
    resident experts, in slot order, and return it.

    Its parameters become capacity-sized stacks: ``weight``: (capacity, out, in) float, or
    (capacity, out, in * bits / 32) uint32 when quantized, with ``scales`` / ``biases``:
    (capacity, out, in / group_size); optional ``bias``: (capacity, out). The stock
    ``__call__`` is unchanged (mlx-lm reads the expert count from ``weight.shape[0]``), so
    it computes exactly as before, taking slot indices where it took expert ids.
    """
    check_projection(stock, slot_rows)
    for param, rows in slot_rows.items():
        # Replaces the stock (still lazy, never evaluated) full-size table.
        setattr(stock, param, mx.stack(rows))
    return stock


def write_slots(module: nn.Module, slots: list[int], rows: dict[str, list[mx.array]]) -> None:
    """Overwrite ``slots`` of a projection made by :func:`cut_to_slots` with new experts'
    tensors (``rows[param][i]`` -> ``slots[i]``).

    Functional updates: a graph still holding the old stack keeps its values, and when
    nothing does MLX reuses the buffer in place.
    """
    for param, new in rows.items():
        stack = module[param]
        for slot, row in zip(slots, new, strict=True):
            stack = mx.slice_update(stack, row[None], mx.array([slot]), axes=(0,))
        setattr(module, param, stack)
