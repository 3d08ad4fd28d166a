"""Session fixtures: one seeded tiny SDAR model and its two real .pte exports."""

from __future__ import annotations

import pytest
import torch

from diffulex_edge.config import tiny_config
from diffulex_edge.export import export_pte
from diffulex_edge.model import random_model

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
    """Both export variants of the tiny model; an export failure errors every user."""
    out = tmp_path_factory.mktemp("pte")
    return {
        variant: export_pte(model, out / f"{variant}.pte", MAX_SEQ, BLOCK, variant).path
        for variant in ("cache_io", "block_kv")
    }
