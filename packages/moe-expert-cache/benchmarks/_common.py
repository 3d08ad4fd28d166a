"""Shared by the benchmarks: the model under test and the JSON/markdown writer."""

from __future__ import annotations

from pathlib import Path

from membound_testing.random_moe import random_moe_config, write_random_moe
from moe_expert_cache import seal_model

RESULTS = Path(__file__).parent / "results"
COMMAND = "hatch run moe-expert-cache:bench"


def bench_model(directory: Path, quick: bool) -> tuple[Path, dict]:
    """The issue's mid-size MoE: Qwen3-MoE, hidden 1024, 8 layers, 64 experts, top-8,
    4-bit, 4 shards. ``quick``: a small one for a smoke run.

    Scales and activations are float32: mlx[cpu] runs bfloat16 about 7x slower (measured
    on this machine), which would time the CPU's bfloat16 path instead of the cache."""
    if quick:
        config = random_moe_config(
            "qwen3_moe",
            hidden_size=256,
            num_layers=4,
            num_experts=16,
            top_k=2,
            expert_size=256,
            vocab_size=1024,
        )
    else:
        config = random_moe_config(
            "qwen3_moe",
            hidden_size=1024,
            num_layers=8,
            num_experts=64,
            top_k=8,
            expert_size=512,
            vocab_size=4096,
            num_heads=16,
            num_kv_heads=4,
        )
    path = write_random_moe(directory, config, bits=4, shards=4, seal=seal_model)
    return path, config


def write_result(
    name: str,
    title: str,
    columns,
    rows,
    targets,
    notes: str,
    quick: bool = False,
    command: str = COMMAND,
) -> dict:
    """results/<name>.json through membound's one results writer (atomic), and its table.
    ``command``: what produced it (the package's bench unless a script was run alone)."""
    from membound_testing.results import write_result as write

    return write(
        RESULTS,
        package="moe-expert-cache",
        name=name,
        title=title,
        command=command + (" --quick" if quick else ""),
        columns=columns,
        rows=rows,
        targets=targets,
        notes=notes,
    )
