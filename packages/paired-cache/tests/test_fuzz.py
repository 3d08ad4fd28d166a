"""Issue #15: seeded argument fuzzing. Every mutated constructor or update argument is
refused with PairedCacheError (the cache unchanged) or accepted exactly as given; none
crashes, hangs or reaches the C core unchecked."""

from __future__ import annotations

import os
from pathlib import Path

import args_fuzz

from membound_testing import fuzz

HERE = Path(__file__).resolve().parent


def test_good_scenarios_run_as_asked(tmp_path):
    assert args_fuzz.check(str(args_fuzz.write_targets(tmp_path))) is True


def test_argument_fuzz(tmp_path, monkeypatch):
    # The worker processes import the checker from this directory.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    target = fuzz.Target(
        root=args_fuzz.write_targets(tmp_path),
        structured=fuzz.mutate_json_bytes,
        structured_share=1.0,
    )
    report = fuzz.run(
        [target],
        "args_fuzz:check",
        ["paired_cache.PairedCacheError"],
        n=600,
        seed=15,
        batch=300,
        timeout=300,
    )
    assert report.bad == {}, report.summary()
    assert report.counts["clean"] > 200, report.summary()
