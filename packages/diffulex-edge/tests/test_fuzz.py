"""Seeded mutation fuzzing of both loaders (issue #15): every damaged file is refused with
DiffulexEdgeError; no crash, hang, unclear error or silent acceptance. Each batch of mutants
is loaded in a fresh process by the checkers in ``fuzz_checkers.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from membound_testing import fuzz

from .fuzz_checkers import checkpoint_targets, pte_targets

TESTS = Path(__file__).parent
CLEAN = ["diffulex_edge.DiffulexEdgeError"]
SEED = 15
MUTANTS = 300  # per loader


def set_checker_env(monkeypatch, original: Path, reach_log: Path | None = None) -> None:
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("DIFFULEX_FUZZ_ORIGINAL", str(original))
    if reach_log is not None:
        monkeypatch.setenv("DIFFULEX_FUZZ_REACH_LOG", str(reach_log))


def test_fuzz_pte_engine(pte_paths, tmp_path, monkeypatch):
    targets = pte_targets(pte_paths["block_kv"], tmp_path / "pte")
    reach_log = tmp_path / "reached.jsonl"
    set_checker_env(monkeypatch, tmp_path / "pte", reach_log)
    report = fuzz.run(
        list(targets.values()), "fuzz_checkers:check_pte", CLEAN, MUTANTS, SEED, batch=MUTANTS
    )
    print(report.summary())
    assert report.bad == {}, report.summary()
    assert sum(report.counts.values()) == MUTANTS
    # The checker's own good-file run reaches ExecuTorch; no damaged mutant may.
    reached = [json.loads(line) for line in reach_log.read_text().splitlines()]
    assert [r for r in reached if not r["pristine"]] == [], reached
    assert report.counts["benign"] == len(reached) - len(targets)


@pytest.mark.parametrize("foreign", [False, True], ids=["with-record", "foreign"])
def test_fuzz_load_checkpoint(model, tmp_path, monkeypatch, foreign):
    targets = checkpoint_targets(model, tmp_path / "ckpt", foreign)
    set_checker_env(monkeypatch, tmp_path / "ckpt")
    report = fuzz.run(
        list(targets.values()),
        "fuzz_checkers:check_checkpoint",
        CLEAN,
        MUTANTS,
        SEED,
        batch=MUTANTS,
    )
    print(report.summary())
    assert sum(report.counts.values()) == MUTANTS
    if foreign:
        # No integrity record: a weight byte or a config value changed to another valid
        # one cannot be detected (README Limits); everything else must be refused cleanly.
        assert {k: v for k, v in report.bad.items() if k != "silent"} == {}, report.summary()
    else:
        assert report.bad == {}, report.summary()
