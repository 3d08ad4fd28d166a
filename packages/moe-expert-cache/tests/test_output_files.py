"""Files the package writes get the mode a plain ``open`` gives under the process's umask
(#19: they were 0600 where a temporary file was renamed into place), and the package ships
``py.typed``."""

from __future__ import annotations

import os
import stat
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest
from conftest import PROMPT

from membound_testing.moefy import MoefyConfig, moefy
from membound_testing.random_moe import random_moe_config, write_random_moe
from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model, seal_model


@pytest.fixture(params=[0o022, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
        for p in [root, *sorted(root.rglob("*"))]
    }


def expect(root: Path, umask: int) -> dict[str, int]:
    return {name: (0o777 if (root / name).is_dir() else 0o666) & ~umask for name in modes(root)}


def test_moefy_checkpoint_follows_the_umask(tmp_path, umask, tiny_llama):
    dense = tiny_llama
    ids = np.random.default_rng(0).integers(0, 128, 96).tolist()
    config = MoefyConfig(num_experts=4, top_k=2, kmeans_iters=2, sequence_length=32, shards=2)
    out = moefy(dense, tmp_path / "moe", ids, config, progress=False, seal=seal_model)
    got = modes(out)
    assert len(got) > 5 and got == expect(out, umask)
    # and what it wrote is a working MoE
    cached = load_cached_model(out, ExpertCacheConfig(capacity_share=0.5))
    assert len(generate(cached.model, [1, 2, 3], 3, cached.manager).tokens) == 3


def test_random_checkpoint_state_and_trace_follow_the_umask(tmp_path, umask):
    root = tmp_path / "out"
    root.mkdir(mode=0o777 & ~umask)
    model = write_random_moe(root / "model", random_moe_config("olmoe"), bits=4, seal=seal_model)
    cached = load_cached_model(model, ExpertCacheConfig(capacity_share=0.5, mode="skip"))
    cached.manager.start_trace()
    generate(cached.model, PROMPT, 4, cached.manager)
    cached.manager.save_state(root / "state.json")
    cached.manager.trace.save(root / "router.trace")
    got = modes(root)
    assert {"model/config.json", "model/moe-expert-cache.integrity.json", "state.json"} <= set(got)
    assert got == expect(root, umask)
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_the_package_ships_py_typed():
    marker = files("moe_expert_cache") / "py.typed"
    assert marker.is_file()
