"""The expert projection over stacked resident tensors, addressed by local slot."""

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


class PredictiveCachedSwitchLinear(nn.Module):
    """Drop-in for ``SwitchLinear`` / ``QuantizedSwitchLinear`` holding ``capacity`` experts.

    Parameters are the stock ones cut to the resident slots:
    ``weight``: (capacity, out, in) float, or (capacity, out, in * bits / 32) uint32 when
    quantized, with ``scales`` / ``biases``: (capacity, out, in / group_size); optional
    ``bias``: (capacity, out). ``__call__`` takes slot indices, not expert ids, and stays lazy.
    """

    def __init__(self, stock: nn.Module, slot_rows: dict[str, list[mx.array]]):
        super().__init__()
        self.quantized = check_projection(stock, slot_rows)
        if self.quantized:
            self.group_size, self.bits, self.mode = stock.group_size, stock.bits, stock.mode
        for param, rows in slot_rows.items():
            setattr(self, param, mx.stack(rows))  # (capacity, ...)
        self.freeze()

    def write_slots(self, slots: list[int], rows: dict[str, list[mx.array]]) -> None:
        """Overwrite ``slots`` with new experts' tensors (``rows[param][i]`` -> ``slots[i]``).

        Functional updates: a graph still holding the old stack keeps its values, and when
        nothing does MLX reuses the buffer in place.
        """
        for param, new in rows.items():
            stack = self[param]
            for slot, row in zip(slots, new, strict=True):
                stack = mx.slice_update(stack, row[None], mx.array([slot]), axes=(0,))
            setattr(self, param, stack)

    def __call__(self, x: mx.array, slots: mx.array, sorted_indices: bool = False) -> mx.array:
        """x: (..., 1, 1, in) float; slots: (..., k) uint32 local slots -> (..., k, 1, out)."""
        if self.quantized:
            x = mx.gather_qmm(
                x,
                self["weight"],
                self["scales"],
                self.get("biases"),
                rhs_indices=slots,
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
                sorted_indices=sorted_indices,
            )
        else:
            x = mx.gather_mm(
                x, self["weight"].swapaxes(-1, -2), rhs_indices=slots, sorted_indices=sorted_indices
            )
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][slots], -2)
        return x
