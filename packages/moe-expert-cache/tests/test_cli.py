"""The command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from moe_expert_cache import read_state
from moe_expert_cache.cli import build_parser, main
from moe_expert_cache.config import MODES
from moe_expert_cache.policies import POLICIES
from moe_expert_cache.profile import pinned_experts
from moe_expert_cache.simulator import SIMULATED
from moe_expert_cache.trace import RouterTrace


def run_main(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def subcommand(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def test_generate_and_simulate(model_dir, tmp_path, capsys):
    path = model_dir("mixtral", 4)
    trace = tmp_path / "router.trace"
    rc = main(
        [
            "generate",
            "--model",
            str(path),
            "--capacity",
            "0.5",
            "--mode",
            "skip",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "8",
            "--trace-out",
            str(trace),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "tokens/s:" in out and "hit rate:" in out
    assert len(out.split("tokens:")[1].splitlines()[0].split()) == 8
    assert main(["simulate", str(trace), "--capacity", "0.5"]) == 0
    table = capsys.readouterr().out
    assert "| belady | 4 |" in table and "| lcp | 4 |" in table
    state = tmp_path / "state.json"
    rc = main(
        [
            "generate",
            "--model",
            str(path),
            "--capacity",
            "4",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "4",
            "--profile",
            str(trace),
            "--pin-share",
            "0.3",
            "--adaptive",
            "--state-out",
            str(state),
        ]
    )
    assert rc == 0
    assert "resident expert bytes:" in capsys.readouterr().out
    saved = read_state(state)
    assert sum(len(r) for r in saved["resident"]) == 8  # adaptive split of 2 x 4 slots
    pins = pinned_experts(RouterTrace.load(trace), 0.3)
    for layer, pinned in enumerate(saved["pinned"]):
        cap = len(saved["resident"][layer])
        assert pinned == sorted(pins[layer][: cap - 2])


def test_generate_bad_capacity(model_dir, capsys):
    code, _, err = run_main(
        ["generate", "--model", str(model_dir("olmoe")), "--capacity", "1", "--prompt-ids", "1"],
        capsys,
    )
    assert code == 2
    assert err.startswith("moe-expert-cache: error: capacity=1 gives 1 experts")
    assert "top_k=2" in err and err.count("\n") == 1


def test_generate_capacity_text_says_share_or_count(model_dir, capsys):
    """``--capacity 1.0`` is a share (every expert), ``--capacity 8`` a count (#56)."""
    path = str(model_dir("olmoe"))
    resident = []
    for value in ("1.0", "8", "0.5", "4"):
        rc = main(["generate", "--model", path, "--capacity", value, "--prompt-ids", "1"])
        assert rc == 0
        out = capsys.readouterr().out
        line = next(ln for ln in out.splitlines() if ln.startswith("resident expert bytes"))
        resident.append(line.split(": ")[1].split(" of "))
    every, half = resident[0][1], int(resident[0][1]) // 2
    assert resident[0] == resident[1] == [every, every]
    assert resident[2] == resident[3] == [str(half), every]


@pytest.mark.parametrize("command", ["generate", "simulate"])
def test_help_shows_every_default(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    code, out, _ = run_main([command, "--help"], capsys)
    assert code == 0
    options = [a for a in subcommand(command)._actions if a.option_strings and a.dest != "help"]
    assert options
    # One entry per option: from its "  --name" line to the next option's.
    parts = re.split(r"\n(?=  -)", out.split("options:")[1])
    entries = {e.split()[0].rstrip(","): e for e in parts if e.strip()}
    for action in options:
        if action.required or action.dest in ("prompt", "prompt_ids"):
            continue  # required: no default to show
        entry = " ".join(entries[action.option_strings[0]].split())
        assert f"(default: {action.default})" in entry, entry
    if command == "generate":
        assert "(default: 0.5)" in out and "(default: exact)" in out and "(default: lcp)" in out


def test_choices_come_from_the_registries():
    generate = {a.dest: a for a in subcommand("generate")._actions}
    assert list(generate["mode"].choices) == list(MODES)
    assert sorted(generate["policy"].choices) == sorted(POLICIES)
    simulate = {a.dest: a for a in subcommand("simulate")._actions}
    assert list(simulate["policies"].choices) == list(SIMULATED)
    assert "belady" in SIMULATED and set(POLICIES) < set(SIMULATED)


def test_every_command_has_a_cmd_function():
    for name in ("generate", "simulate"):
        handler = subcommand(name).get_default("handler")
        assert handler.__name__ == f"cmd_{name}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-ids", "1000000"], "prompt_ids must be token ids in [0, vocab_size=256)"),
        (["--prompt", "hi"], "--prompt needs a tokenizer, and "),
        (["--prompt-ids", "1", "--adaptive"], "--pin-share and --adaptive need --profile"),
        (["--prompt-ids", "1", "--state-in", "{missing}"], "No such file"),
        (["--prompt-ids", "1", "--state-in", "{garbage}"], "garbage.json: not a checksummed"),
    ],
)
def test_expected_errors_are_one_line(model_dir, tmp_path, capsys, args, message):
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    args = [a.format(missing=tmp_path / "missing.json", garbage=garbage) for a in args]
    code, _, err = run_main(["generate", "--model", str(model_dir("mixtral")), *args], capsys)
    assert code == 2
    assert err.startswith("moe-expert-cache: error: ") and message in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "prompt_ids must hold at least one token" not in err


def test_a_missing_model_directory_is_one_line(tmp_path, capsys):
    code, _, err = run_main(
        ["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"], capsys
    )
    assert code == 2
    assert err == f"moe-expert-cache: error: no config.json in {tmp_path / 'nope'}\n"


@pytest.mark.parametrize(("option", "value"), [("--capacity", "x"), ("--prompt-ids", "1,a")])
def test_bad_option_values_are_argparse_errors(model_dir, capsys, option, value):
    args = ["generate", "--model", str(model_dir("mixtral")), option, value]
    if option != "--prompt-ids":
        args += ["--prompt-ids", "1"]
    code, _, err = run_main(args, capsys)
    assert code == 2 and f"argument {option}: {value!r}" in err


def test_out_of_vocabulary_prompt_ids_in_a_subprocess(model_dir):
    """Before 0.4 this reached MLX's embedding lookup: a segfault (status -11)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_expert_cache.cli",
            "generate",
            "--model",
            str(model_dir("mixtral")),
            "--prompt-ids",
            "1,1000000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr == (
        "moe-expert-cache: error: prompt_ids must be token ids in [0, vocab_size=256), "
        "got [1000000]\n"
    )
