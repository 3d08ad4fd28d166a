"""Issue #15: seeded config fuzzing. Every mutated config is refused with BMRTError or
accepted exactly as given; none crashes, hangs, is coerced or fails mid-stream."""

from __future__ import annotations

import os
from pathlib import Path

import config_fuzz
import pytest

from bmrt_kv import BMRTConfig
from membound_testing import fuzz

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("name", sorted(config_fuzz.GOOD))
def test_good_configs_run_a_stream(name):
    # The fuzz checker smoke-runs only configs that differ from these, so run these here.
    config_fuzz.smoke(BMRTConfig.from_dict(config_fuzz.GOOD[name]))


def test_config_fuzz(tmp_path, monkeypatch):
    # The worker processes import the checker from this directory.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    target = fuzz.Target(
        root=config_fuzz.write_targets(tmp_path),
        structured=fuzz.mutate_json_bytes,
        structured_share=1.0,
    )
    report = fuzz.run(
        [target], "config_fuzz:check", ["bmrt_kv.BMRTError"], n=400, seed=15, batch=200, timeout=300
    )
    assert report.bad == {}, report.summary()
    assert report.counts["clean"] > 200, report.summary()
