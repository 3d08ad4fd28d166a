"""The CLI's conventions: defaults in --help, one-line errors with exit status 2."""

import re

import pytest

from bmrt_kv.cli import build_parser, main


def run_main(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    code, out, _ = run_main(["run", "--help"], capsys)
    assert code == 0
    sub = build_parser()._subparsers._group_actions[0].choices["run"]
    assert_every_default_shown(sub, out)


def assert_every_default_shown(parser, out):
    """Each option of ``parser`` shows its default in the help text ``out``."""
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
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
    "args",
    [
        ["eval"],
        ["eval", "--help"],
        ["eval", "--model", "m", "--tasks", "passkey", "--lengths", "2000"],
    ],
)
def test_eval_says_where_the_evaluation_moved(args, capsys):
    """The evaluation left the wheel (#56): `bmrt-kv eval`, with any arguments, is one line
    naming the script to run from a checkout, exit status 2."""
    code, out, err = run_main(args, capsys)
    assert code == 2 and out == ""
    assert err.startswith("bmrt-kv: error: `bmrt-kv eval` left the bmrt-kv wheel in 0.11.0")
    assert "python packages/bmrt-kv/benchmarks/retrieval.py" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_run_still_rejects_an_unknown_flag(tmp_path, capsys):
    code, _, err = run_main(
        ["run", str(tmp_path / "x.txt"), "--model", "m", "--question", "q", "--tasks", "a"], capsys
    )
    assert code == 2 and "unrecognized arguments: --tasks a" in err


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


def test_the_wheel_ships_py_typed():
    from importlib.resources import files

    assert files("bmrt_kv").joinpath("py.typed").is_file()
