"""SparseMLP: a gated MLP (Llama/Qwen style) computed over its cached active rows only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paired_cache.cache import PairedCache
from paired_cache.config import CacheConfig
from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import (
    MASK_SOURCES,
    Activation,
    MaskSource,
    active_rows,
    make_source,
)

GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def is_gated_mlp(module: nn.Module) -> bool:
    """A module computing down_proj(act_fn(gate_proj x) * up_proj x), as LlamaMLP does."""
    return all(hasattr(module, part) for part in GATED_MLP_PARTS)


class SparseMLP(nn.Module):
    """down(act(gate x) * up x) over the rows a mask source picks for each token.

    The PairedCache holds the weights (pools) and the packed active rows; gate and up of
    one neuron sit side by side in one row, so one matmul over the (2m, hidden) view gives
    both. forward: x (..., hidden) float -> (..., hidden). With a full mask it equals the
    dense MLP up to float rounding.
    """

    def __init__(self, cache: PairedCache, act: Activation, source: MaskSource) -> None:
        super().__init__()
        if cache.gate_cols == 0 or cache.gate_cols != cache.up_cols:
            raise PairedCacheError(
                f"SparseMLP needs a gate with as many columns as up, got gate_cols="
                f"{cache.gate_cols}, up_cols={cache.up_cols}"
            )
        if source.n_rows != cache.n_rows or source.k > cache.capacity:
            raise PairedCacheError(
                f"mask source picks {source.k} of {source.n_rows} rows; the cache has "
                f"N={cache.n_rows}, capacity={cache.capacity}"
            )
        self.cache, self.act_fn, self.source = cache, act, source

    @classmethod
    def from_mlp(
        cls,
        mlp: nn.Module,
        source: str,
        fraction: float,
        calibration: torch.Tensor | None = None,
        config: CacheConfig | None = None,
        **options,
    ) -> SparseMLP:
        """Wrap a gated MLP; source names a MASK_SOURCES entry, calibration is (T, hidden)
        inputs of this MLP for the sources that fit to data."""
        if not is_gated_mlp(mlp):
            raise PairedCacheError(
                f"{type(mlp).__name__} is not a gated MLP (needs {GATED_MLP_PARTS})"
            )
        parts = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(getattr(p, "bias", None) is not None for p in parts):
            raise PairedCacheError("SparseMLP supports bias-free projections only")
        if source not in MASK_SOURCES:
            raise PairedCacheError(f"unknown mask source {source!r}; known: {sorted(MASK_SOURCES)}")
        with torch.no_grad():
            gate, up, down = (p.weight.detach().contiguous() for p in parts)
            capacity = active_rows(fraction, gate.shape[0])
            cache = PairedCache(up, down, gate, capacity=capacity, config=config)
            # The source reads the cache's pools: no second copy of gate and up.
            src = make_source(
                source, cache.gate_pool, cache.up_pool, mlp.act_fn, fraction, calibration, **options
            )
        return cls(cache, mlp.act_fn, src)

    def _active_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over the m active rows."""
        m, hidden = self.cache.num_active, self.cache.gate_cols
        gate_up = self.cache.gate_up().view(2 * m, hidden)  # rows g_0, u_0, g_1, u_1, ...
        h2 = F.linear(x, gate_up).view(x.shape[0], m, 2)  # (T, m, 2)
        # The activation gets a contiguous copy of the gate column: on a strided input torch
        # takes its scalar loop, whose exp rounds differently from the vectorised one that
        # the dense MLP's contiguous gate output gets, and that last-bit difference grows
        # through the layers (1.6e-4 in SmolLM2's float32 logits).
        h = self.act_fn(h2[..., 0].contiguous()) * h2[..., 1]  # (T, m)
        return F.linear(h, self.cache.down())  # down(): (hidden, m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(self.cache.dtype)  # (T, hidden)
        if not self.source.per_token:
            self.cache.update(self.source.select(flat[0]))
            out = self._active_forward(flat)
        else:
            out = torch.empty_like(flat)
            # One mask per token, as in decoding: a prompt runs token by token here.
            for t in range(flat.shape[0]):
                self.cache.update(self.source.select(flat[t]))
                out[t] = self._active_forward(flat[t : t + 1])[0]
        return out.view(shape).to(x.dtype)


def collect_mlp_inputs(model: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run model on input_ids (B, T) and return each gated MLP's inputs, (B*T, hidden)."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if is_gated_mlp(module):

            def hook(_module, args, name=name):
                x = args[0]
                inputs[name] = x.detach().reshape(-1, x.shape[-1]).clone()

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def sparsify_model(
    model: nn.Module,
    source: str,
    fraction: float,
    calibration_ids: torch.Tensor | None = None,
    config: CacheConfig | None = None,
    **options,
) -> list[SparseMLP]:
    """Replace every gated MLP of model by a SparseMLP in place and return them in order.

    calibration_ids: (1, T) token ids whose MLP inputs fit "lowrank" and "fixed" sources.
    """
    names = [name for name, module in model.named_modules() if is_gated_mlp(module)]
    if not names:
        raise PairedCacheError(
            f"{type(model).__name__} has no gated MLP (modules with {GATED_MLP_PARTS})"
        )
    calibration = collect_mlp_inputs(model, calibration_ids) if calibration_ids is not None else {}
    replaced = []
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        sparse = SparseMLP.from_mlp(
            getattr(parent, child), source, fraction, calibration.get(name), config, **options
        )
        setattr(parent, child, sparse)
        replaced.append(sparse)
    return replaced
