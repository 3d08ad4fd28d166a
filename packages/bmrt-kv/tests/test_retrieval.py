"""benchmarks/retrieval.py, `bmrt-kv eval` before 0.11.0: defaults in --help, the suite's
tasks and the pass key scored from the command line, and its JSON written atomically."""

import json
import os

import pytest
import retrieval
from test_cli import assert_every_default_shown


def test_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    with pytest.raises(SystemExit) as exit_info:
        retrieval.main(["--help"])
    assert exit_info.value.code == 0
    assert_every_default_shown(retrieval.build_parser(), capsys.readouterr().out)


def test_a_bad_model_is_one_line_not_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        retrieval.main(["--model", str(tmp_path / "missing"), "--samples", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("retrieval.py: error: --model") and "no such directory" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_output_gets_the_umask_and_no_temporary_is_left(tmp_path):
    old = os.umask(0o027)
    try:
        retrieval.write_json(tmp_path / "rows.json", [{"a": 1}])
    finally:
        os.umask(old)
    assert (tmp_path / "rows.json").stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]


def test_runs_the_suites_tasks(tmp_path):
    """`--tasks` scores the RULER-style suite's tasks (and the pass key) by exact match,
    one row per task, length, selector and budget."""
    from membound_testing import smollm2_gguf_path

    out = tmp_path / "rows.json"
    code = retrieval.main(
        [
            "--model",
            str(smollm2_gguf_path()),
            "--tasks",
            "single_word",
            "passkey",
            "--lengths",
            "1000",
            "--samples",
            "1",
            "--budgets",
            "256",
            "--selectors",
            "keydiff",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())
    got = {(r["task"], r["selector"], r["budget"]): (r["accuracy"], r["samples"]) for r in rows}
    assert set(got) == {
        ("single_word", "full", None),
        ("single_word", "keydiff", 256),
        ("passkey", "full", None),
        ("passkey", "keydiff", 256),
    }
    # The full cache answers both tasks at 1k tokens (measured: 2/2 each with 2 samples); a
    # task wired to the wrong samples or scorer would not.
    assert got[("single_word", "full", None)] == (1.0, 1)
    assert got[("passkey", "full", None)] == (1.0, 1)
