"""Session fixtures: one seeded tiny SDAR model and its three real .pte exports.

The test models, the toy sorting task and its checkpoint are not in the wheel (#56): they
live in ``benchmarks/`` (``random_sdar.py``, ``sort_task.py``, ``checkpoints/sort8``), which
is put on ``sys.path`` here for every test module.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from random_sdar import random_model  # noqa: E402

from diffulex_edge.config import tiny_config  # noqa: E402
from diffulex_edge.export import export_pte  # noqa: E402

MAX_SEQ = 64
BLOCK = 4

# The suite's matrices are small: one intra-op thread avoids OpenMP threads spinning
# against each other (and against other jobs) on the 2-core CI machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def config():
    return tiny_config()


@pytest.fixture(scope="session")
def model(config):
    torch.manual_seed(0)
    return random_model(config, seed=0)


@pytest.fixture(scope="session")
def pte_paths(model, tmp_path_factory):
    """Every export variant of the tiny model; an export failure errors every user."""
    out = tmp_path_factory.mktemp("pte")
    return {
        variant: export_pte(model, out / f"{variant}.pte", MAX_SEQ, BLOCK, variant).path
        for variant in ("cache_io", "block_kv", "static_kv")
    }


SMOLLM2_MAX_SEQ = 256
SMOLLM2_PREFILL = 32


def _smollm2_pte(variant: str):
    """SmolLM2-135M-Instruct exported once per export code (block size 1, fp32, prompt
    chunks of 32; keyed by ``export_code_digest``) under the membound cache: the export takes
    minutes on the 2-core machine, so later sessions reuse it (PteEngine still verifies its
    record)."""
    from diffulex_edge.checkpoint import load_checkpoint
    from diffulex_edge.export import export_code_digest
    from membound_testing.models import cache_dir, smollm2_float_dir

    suffix = "" if variant == "block_kv" else f"-{variant}"
    path = cache_dir() / (
        f"diffulex-edge-export-{export_code_digest()[:12]}-smollm2-f32-"
        f"{SMOLLM2_MAX_SEQ}-1-{SMOLLM2_PREFILL}{suffix}.pte"
    )
    if not (path.is_file() and path.with_name(path.name + ".json").is_file()):
        path.parent.mkdir(parents=True, exist_ok=True)
        model = load_checkpoint(smollm2_float_dir())
        export_pte(model, path, SMOLLM2_MAX_SEQ, 1, variant, prefill_size=SMOLLM2_PREFILL)
    return path


@pytest.fixture(scope="session")
def smollm2_pte():
    """block_kv: a 32-token prefill method beside forward (the budget runner's file too)."""
    return _smollm2_pte("block_kv")


@pytest.fixture(scope="session")
def smollm2_static_pte():
    """static_kv: the cache inside the program, ExecuTorch's LLM ops."""
    return _smollm2_pte("static_kv")
