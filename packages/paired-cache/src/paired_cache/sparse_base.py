"""What every sparse MLP module shares: its options' checks, and the refusals that keep a
model whose MLP weights live in paired caches from being saved or converted."""

from __future__ import annotations

import torch
from torch import nn

from paired_cache.errors import PairedCacheError

# How a forward of several tokens (a prompt) runs its MLP: "sparse", one mask per token,
# as in decoding; "dense", every row at once, as the dense MLP does.
PREFILL_MODES = ("sparse", "dense")

SAVE_REFUSED = (
    "a SparseMLP keeps its weights in its paired cache (C memory, or the mapped pool file), "
    "not in parameters, so a state_dict or save_pretrained checkpoint would hold no MLP "
    "weights. Save the dense model instead, before sparsify_model (paired_cache.save_dense("
    "model, MODEL_DIR), or save_pretrained), write its neuron pools with "
    "paired_cache.convert(MODEL_DIR, POOL) (or `paired-cache convert MODEL_DIR POOL`), and "
    "load both back with paired_cache.load_sparse(MODEL_DIR, POOL, source, fraction)"
)


def check_prefill(prefill) -> None:
    if not isinstance(prefill, str) or prefill not in PREFILL_MODES:
        raise PairedCacheError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")


def check_window(window) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 1024:
        raise PairedCacheError(f"window must be an int in [1, 1024] tokens, got {window!r}")


def check_not_offloaded(parts: list[nn.Module], what: str) -> None:
    """Refuse projections whose weights accelerate left on the meta device."""
    # The registered parameter, not getattr: a compressed linear's weight property decodes.
    weights = [getattr(p, "_parameters", {}).get("weight") for p in parts]
    if any(isinstance(w, torch.Tensor) and w.is_meta for w in weights):
        raise PairedCacheError(
            f"{what}: its weights are on the meta device (offloaded by accelerate: a "
            f"device_map with 'disk' or 'cpu' offload, or init_empty_weights); offloaded "
            f"weights are not supported, the cache copies them from CPU memory. Load the "
            f"model without offload (no device_map, or device_map={{'': 'cpu'}}), or keep "
            f"the MLPs on storage the package's way: paired_cache.convert(MODEL_DIR, POOL) "
            f"and paired_cache.load_sparse(MODEL_DIR, POOL, ...)"
        )


class CachedMLP(nn.Module):
    """A module whose MLP weights are a PairedCache's (self.cache): refuses state_dict and
    any dtype or device move, which the cache's C buffers cannot follow."""

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        raise PairedCacheError(f"{prefix.rstrip('.') or type(self).__name__}: {SAVE_REFUSED}")

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the MLP's weights are held in (and its inputs computed in)."""
        return self.cache.dtype

    def check_move(self, fn) -> None:
        """Refuse a Module._apply function (.to, .half, .cuda, ...) that would change the
        dtype or device of a tensor: the cache's C buffers cannot follow it."""
        probe = torch.zeros(1, dtype=self.weight_dtype)
        moved = fn(probe)
        if isinstance(moved, torch.Tensor) and (
            moved.dtype != probe.dtype or moved.device != probe.device
        ):
            raise PairedCacheError(
                f"a {type(self).__name__}'s weights are {self.weight_dtype} CPU memory in its "
                f"paired cache and cannot become {moved.dtype} on {moved.device}: move or "
                f"convert the dense model before sparsify_model, or load_sparse a pool file "
                f"converted from a checkpoint in that dtype"
            )

    def _apply(self, fn, recurse: bool = True):
        self.check_move(fn)
        return super()._apply(fn, recurse)
