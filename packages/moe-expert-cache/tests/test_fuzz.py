"""Damaged files are refused cleanly: seeded mutants of every loader's files, each batch
loaded in a fresh process (membound_testing.fuzz), must be refused with ExpertCacheError or
load exactly what the file says: 0 crash, 0 hang, 0 unclear, 0 silent."""

from __future__ import annotations

import os
from pathlib import Path

import fuzz_checkers
import pytest

from membound_testing import fuzz

TESTS = Path(__file__).parent
MUTANTS = 300  # per loader; a few seconds to a minute each on 2 cores


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    return fuzz_checkers.make_references(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture
def worker_env(refs, monkeypatch):
    """The worker processes import fuzz_checkers from here and find the references."""
    monkeypatch.setenv("MOE_FUZZ_REFS", str(refs))
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(TESTS), path) if p))
    return refs


LOADER_NAMES = [
    "expert store (sealed shards, index, integrity record)",
    "load_cached_model (config.json, sealed)",
    "load_cached_model (shards and index without integrity record)",
    "warm-start state (read_state + slots)",
    "RouterTrace.load",
]


@pytest.mark.parametrize("loader", LOADER_NAMES)
def test_fuzz_loader(worker_env, loader):
    targets, checker = fuzz_checkers.loaders(worker_env)[loader]
    report = fuzz.run(targets, checker, fuzz_checkers.CLEAN_ERRORS, n=MUTANTS, seed=15)
    assert report.bad == {}, report.summary()
    assert report.counts["clean"] > 0, report.summary()


def test_fuzz_foreign_config(worker_env):
    """config.json without an integrity record: never a crash, hang or unclear error.
    Silent loads are expected here and only here: a valid value rewritten to another valid
    value (rope_theta 10000 -> 1) is indistinguishable from a real config (README, Limits).
    The sealed variant above allows none."""
    targets, checker = fuzz_checkers.foreign_config(worker_env)
    report = fuzz.run(targets, checker, fuzz_checkers.CLEAN_ERRORS, n=MUTANTS, seed=15)
    bad = {c: n for c, n in report.bad.items() if c != "silent"}
    assert bad == {}, report.summary()
