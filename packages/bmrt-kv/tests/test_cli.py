"""The CLI's conventions: defaults in --help, one-line errors with exit status 2."""

import re

import pytest

from bmrt_kv.cli import build_parser, main


def run_main(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.mark.parametrize("command", ["run", "eval"])
def test_help_shows_every_default(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    code, out, _ = run_main([command, "--help"], capsys)
    assert code == 0
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert options
    # One entry per option: from its "  --name" line to the next option's.
    parts = re.split(r"\n(?=  -)", out.split("options:")[1])
    entries = {e.split()[0].rstrip(","): e for e in parts if e.strip()}
    for action in options:
        entry = " ".join(entries[action.option_strings[0]].split())
        assert f"(default: {action.default})" in entry, entry
    assert "(default: 8)" in out and "(default: agnostic)" in out
    assert "None: min(512, budget), query-aware min(512, 2 x budget) (default: None)" in " ".join(
        out.split()
    )


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("no/such/dir", "no such directory or .gguf file"),
        ("README.md", "must be a .gguf model"),
        (".", "has no config.json"),
    ],
)
def test_a_bad_model_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch, model, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("x")
    (tmp_path / "in.txt").write_text("text")
    code, _, err = run_main(["run", "in.txt", "--model", model, "--question", "q"], capsys)
    assert code == 2
    assert err.startswith("bmrt-kv: error: --model") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_missing_input_file_is_named(tmp_path, capsys):
    code, _, err = run_main(
        ["run", str(tmp_path / "missing.txt"), "--model", str(tmp_path), "--question", "q"],
        capsys,
    )
    assert code == 2 and "missing.txt: no such file to read" in err


def test_run_reads_the_shipped_gguf(tmp_path, capsys):
    from membound_testing import smollm2_gguf_path

    notes = tmp_path / "notes.txt"
    notes.write_text("Note: the meeting with Anna is on Tuesday at the harbour office.")
    code = main(
        [
            "run",
            str(notes),
            "--model",
            str(smollm2_gguf_path()),
            "--question",
            "On which day is the meeting with Anna?",
            "--max-new-tokens",
            "12",
        ]
    )
    assert code == 0
    assert "Tuesday" in capsys.readouterr().out


def test_eval_output_gets_the_umask_and_no_temporary_is_left(tmp_path):
    import os

    from bmrt_kv.cli import _write_json

    old = os.umask(0o027)
    try:
        _write_json(tmp_path / "rows.json", [{"a": 1}])
    finally:
        os.umask(old)
    assert (tmp_path / "rows.json").stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]


def test_the_wheel_ships_py_typed():
    from importlib.resources import files

    assert files("bmrt_kv").joinpath("py.typed").is_file()


def test_eval_runs_the_suites_tasks(tmp_path, capsys):
    """`bmrt-kv eval --tasks` scores the RULER-style suite's tasks (and the pass key) by
    exact match, one row per task, length, selector and budget."""
    import json

    from membound_testing import smollm2_gguf_path

    out = tmp_path / "rows.json"
    code = main(
        [
            "eval",
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
