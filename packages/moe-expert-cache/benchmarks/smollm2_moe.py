"""The real MoE of the benchmarks: SmolLM2-135M-Instruct MoEfied into 16 experts of 96
neurons per layer (membound_testing.moefy), built once under membound's cache directory."""

from __future__ import annotations

from pathlib import Path

from membound_testing.moefy import MoefyConfig, moefy_cached
from moe_expert_cache import seal_model


def smollm2_moe(config: MoefyConfig | None = None, progress: bool = True) -> Path:
    """Path of the MoE checkpoint, built on first use (minutes on 2 cores)."""
    from membound_testing.models import cache_dir, smollm2_float_dir

    return moefy_cached(smollm2_float_dir(), cache_dir(), config, progress, seal=seal_model)
