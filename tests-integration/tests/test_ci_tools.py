"""tools/test_all.py (README command 2, what CI runs) fails clearly, not midway, when the
disk is full: a CI run on 2026-12-06 died of "No space left on device" ten minutes in, and its
last line was a JUnit parse traceback instead of the summary."""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture
def test_all(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    module = importlib.import_module("test_all")
    yield module
    sys.modules.pop("test_all", None)


def test_a_truncated_junit_file_counts_nothing_and_says_so(test_all, tmp_path, capsys):
    junit = tmp_path / "step.xml"
    junit.write_text("")  # what a full disk left
    assert test_all._counts(junit) == (0, 0, 0)
    assert f"unreadable JUnit file {junit}" in capsys.readouterr().out
    junit.write_text('<testsuite tests="5" failures="1" errors="1" skipped="1"/>')
    assert test_all._counts(junit) == (2, 2, 1)


def test_too_little_free_space_stops_the_suite_before_any_step(test_all, monkeypatch, capsys):
    assert test_all._free_space_error(0) is None
    error = test_all._free_space_error(1e9)
    assert f"under {tempfile.gettempdir()}" in error and "at least 1e+09 GiB" in error
    monkeypatch.setattr(test_all, "MIN_FREE_GIB", 1e9)
    started = []
    monkeypatch.setattr(test_all, "_start", lambda *a: started.append(a))
    monkeypatch.setattr(test_all, "refresh", lambda env: started.append(env))
    monkeypatch.setattr(sys, "argv", ["test_all.py", "--only", "memcheck"])
    assert test_all.main() == 1
    assert started == []
    assert "test-all: not run: only" in capsys.readouterr().err


def test_steps_keep_only_failed_tests_temporary_directories(test_all, monkeypatch, tmp_path):
    seen = {}

    class Popen:
        def __init__(self, command, cwd, env, stdout, stderr):
            seen.update(env)

    monkeypatch.setattr(test_all.subprocess, "Popen", Popen)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    test_all._start("integration", ["pytest"], "default", tmp_path, 1)
    assert seen["PYTEST_ADDOPTS"] == "-o tmp_path_retention_policy=failed"
    monkeypatch.setenv("PYTEST_ADDOPTS", "-x")  # a developer's own options win
    test_all._start("integration", ["pytest"], "default", tmp_path, 1)
    assert seen["PYTEST_ADDOPTS"] == "-x"
