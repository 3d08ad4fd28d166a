"""The mask sources by name: what sparsify_model, load_sparse, the command line and the
benchmarks enumerate. The concrete sources are imported here, so that none of them needs
the registry (mask_sources <- trained_predictor <- registry <- sparse_mlp)."""

from __future__ import annotations

import torch

from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import (
    Activation,
    CatsMask,
    FixedMask,
    LowRankPredictor,
    MaskSource,
    OracleTopK,
)
from paired_cache.trained_predictor import TrainedPredictor

MASK_SOURCES: dict[str, type[MaskSource]] = {
    "oracle": OracleTopK,
    "cats": CatsMask,
    "lowrank": LowRankPredictor,
    "fixed": FixedMask,
    "trained": TrainedPredictor,
}


def source_class(name: str) -> type[MaskSource]:
    """The MaskSource class registered under a name.

    Args:
        name: a key of MASK_SOURCES.

    Returns:
        The class (not an instance).

    Raises:
        PairedCacheError: an unknown name, with the known ones.
    """
    if name not in MASK_SOURCES:
        raise PairedCacheError(f"unknown mask source {name!r}; known: {sorted(MASK_SOURCES)}")
    return MASK_SOURCES[name]


def make_source(
    name: str,
    gate: torch.Tensor,
    up: torch.Tensor,
    act: Activation,
    fraction: float,
    calibration: torch.Tensor | None = None,
    **options,
) -> MaskSource:
    """Build the source registered under a name for one MLP.

    Args:
        name: a key of MASK_SOURCES.
        gate, up: (N, hidden) float, the MLP's gate and up weights.
        act: the MLP's activation.
        fraction: the share of the N rows each token keeps, in (0, 1].
        calibration: (T, hidden) float inputs of this MLP, for the sources whose
            needs_calibration is set ("lowrank", "fixed"); None for the others.
        **options: the source's own options (CATS's threshold, the trained predictor's
            weights, the low-rank predictor's rank).

    Returns:
        The MaskSource.

    Raises:
        PairedCacheError: an unknown name, or an option the source refuses.
    """
    return source_class(name).build(gate, up, act, fraction, calibration, **options)


__all__ = ["MASK_SOURCES", "make_source", "source_class"]
