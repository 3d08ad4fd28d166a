"""The CLI's conventions (#19): defaults in --help, choices from the registries, one-line
errors with exit status 2 instead of tracebacks, and the README command lines that failed."""

import re

import pytest
import torch
import transformers
from random_sdar import random_model
from sort_task import trained_checkpoint

from diffulex_edge.cli import (
    BENCH_MOVED,
    NO_SOURCE,
    SORT8_CHECKOUT,
    _tiny_model,
    build_parser,
    main,
)
from diffulex_edge.config import tiny_config
from diffulex_edge.export import EXPORT_VARIANTS, QUANTIZATIONS
from diffulex_edge.remasking import REMASKING
from diffulex_edge.runtime import PteEngine

COMMANDS = ["export", "generate"]
# The toy sorting model, the default source before 0.10.0: a checkout's benchmarks/ holds it.
SORT8 = str(trained_checkpoint())


def _subparser(command):
    return build_parser()._subparsers._group_actions[0].choices[command]


def _one_error_line(err: str, *needles: str) -> None:
    # Our own notes, and the lines ExecuTorch's threadpool prints natively when the first
    # program loads (cpuinfo probing; no API turns them off), are not the error.
    others = ("diffulex-edge: note:", "[cpuinfo_utils.cpp:")
    err = "".join(line for line in err.splitlines(True) if not line.startswith(others))
    assert err.startswith("diffulex-edge: error: "), err
    assert "Traceback" not in err and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_default(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    options = [a for a in _subparser(command)._actions if a.option_strings and a.dest != "help"]
    assert options
    parts = re.split(r"\n(?=  -)", out.split("options:")[1])
    entries = {e.split()[0].rstrip(","): " ".join(e.split()) for e in parts if e.strip()}
    for action in options:
        entry = entries[action.option_strings[0]]
        assert "(default: " in entry, entry
        if action.default is not None:  # a None default states its meaning in words
            assert f"(default: {action.default})" in entry, entry
    if command == "export":
        assert "(default: 64 for SDAR, 256 for a model without a mask token" in out
        assert "(default: block_kv)" in out
    if command == "generate":
        assert "(default: low_confidence_dynamic)" in out and "(default: 12)" in out


def test_choices_come_from_the_registries():
    choices = {
        (command, a.dest): a.choices
        for command in COMMANDS
        for a in _subparser(command)._actions
        if a.choices is not None
    }
    assert list(choices[("export", "variant")]) == sorted(EXPORT_VARIANTS)
    assert tuple(choices[("export", "quantize")]) == QUANTIZATIONS
    assert list(choices[("generate", "remasking")]) == sorted(REMASKING)


def test_the_moved_sort_bench_takes_the_options_bench_took():
    """`diffulex-edge bench` left the wheel with the toy model (#56); the script it names
    takes the same options, its remasking choices from the registry."""
    from sort_bench import build_parser as bench_parser

    options = {a.dest: a for a in bench_parser()._actions if a.option_strings}
    assert {"prompts", "threads", "remasking"} <= set(options)
    assert list(options["remasking"].choices) == sorted(REMASKING)
    assert options["prompts"].default == 20 and options["threads"].default == 1


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--prompts", "5", "--threads", "2"]])
def test_bench_says_what_to_run_from_a_checkout(argv, capsys):
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, BENCH_MOVED, "benchmarks/sort_bench.py")


@pytest.mark.parametrize(
    "argv", [["export", "-o", "{tmp}/m.pte"], ["generate", "--prompt", "31415926"]]
)
def test_no_source_names_the_sources_and_where_the_toy_model_went(argv, tmp_path, capsys):
    """The bundled sorting model was the default source; it left the wheel in 0.10.0."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, NO_SOURCE, "MODEL_DIR", "--tiny", SORT8_CHECKOUT)
    assert list(tmp_path.iterdir()) == []
    assert SORT8.endswith(SORT8_CHECKOUT)  # the path it names is the checkout's


def test_unknown_options_are_still_refused_outside_bench(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--tiny", "--prompt", "12", "--no-such-option"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_tiny_is_the_tests_seeded_tiny_model():
    """--tiny builds, without the test helper, what random_model(tiny_config(), seed=0) does
    (the .pte fixtures' model, which test_cli_and_trained compares it with)."""
    ours, theirs = _tiny_model().state_dict(), random_model(tiny_config(), seed=0).state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)


def test_export_past_the_models_max_position_embeddings_says_the_limit(tmp_path, capsys):
    """#19: `export --checkpoint DIR --max-seq 256` on the sorting checkpoint (max 64)."""
    out = tmp_path / "model.pte"
    argv = ["export", "--checkpoint", SORT8, "-o", str(out)]
    assert main([*argv, "--max-seq", "256"]) == 2
    _one_error_line(capsys.readouterr().err, "max_position_embeddings 64", "--max-seq 64")
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    assert main([*argv, "--max-seq", "64"]) == 0  # what the README now says
    assert PteEngine(out).layout.max_seq == 64


def test_tiny_says_on_stderr_that_its_weights_are_random(capsys):
    """#19: `--tiny` printed <57><57>... with no word that the weights are random."""
    assert main(["generate", "--tiny", "--prompt", "1234", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "random" in captured.err and "untrained" in captured.err
    assert "random" not in captured.out  # stdout stays the tokens alone


def test_prompt_ids_that_end_at_once_say_why(capsys):
    """#19: `generate --prompt-ids 1,2,3` printed `[]` and nothing else."""
    assert main(["generate", SORT8, "--prompt-ids", "1,2,3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "[]"
    assert (
        "no tokens generated" in captured.err and "end-of-sequence token (token 11)" in captured.err
    )


def test_the_readme_prompt_ids_line_sorts(capsys):
    argv = ["generate", SORT8, "--prompt-ids", "3,1,4,1,5,9,2,6,10"]
    assert main([*argv, "--temperature", "0.8", "--top-p", "0.9", "--seed", "0"]) == 0
    assert capsys.readouterr().out.strip() == "[1, 1, 2, 3, 4, 5, 6, 9]"


@pytest.mark.parametrize(
    ("bundled", "tiny"), [("1000000", "1000000"), ("-1", "-1"), ("3,16", "3,64")]
)
def test_token_ids_outside_the_vocabulary_are_refused(bundled, tiny, pte_paths, capsys):
    """An out-of-range id was an IndexError traceback (eager) and reached ExecuTorch (.pte).
    The sorting model's vocabulary is 16 tokens, the tiny .pte's 64."""
    assert main(["generate", SORT8, "--prompt-ids", bundled]) == 2
    _one_error_line(capsys.readouterr().err, "outside the model's vocabulary [0, 16)")
    argv = ["generate", "--pte", str(pte_paths["block_kv"]), "--prompt-ids", tiny]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, "outside the model's vocabulary [0, 64)")


def test_a_file_that_is_not_a_pte_is_one_line(tmp_path, capsys):
    """#19: a non-.pte file given to generate said "error: 0x:23"."""
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    argv = ["generate", "--pte", str(notes), "--prompt", "31415926"]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, "notes.txt has no integrity record")
    assert main([*argv, "--allow-unverified"]) == 2
    _one_error_line(capsys.readouterr().err, "notes.txt is not an ExecuTorch program")
    assert main(["generate", "--pte", str(tmp_path / "none.pte"), "--prompt", "1"]) == 2
    _one_error_line(capsys.readouterr().err, "no .pte at")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--checkpoint", "no/such/dir", "--prompt", "1"], "no/such/dir"),
        (["generate", "--tokenizer", "no/such/dir", "--prompt", "hi"], "--tokenizer no/such/dir"),
        (["generate", "--prompt-ids", "1,x"], "comma-separated ints"),
        (["generate", "{sort8}", "--prompt", "12", "--max-new-tokens", "100"], "max_seq 64"),
        (["generate", "{sort8}", "--prompt", "31415926", "--top-p", "0"], "top_p"),
        (["export", "--tiny", "-o", "{tmp}/t.pte", "--block-size", "3"], "block_size"),
    ],
)
def test_expected_errors_are_one_line_with_exit_status_2(argv, needle, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{sort8}", SORT8) for a in argv]
    assert main(argv) == 2
    _one_error_line(capsys.readouterr().err, needle)


def test_a_llama_checkpoint_where_sdar_is_the_default_decodes_autoregressively(tmp_path, capsys):
    """#19: a Llama checkpoint failed with "missing q_norm..."; it now loads and decodes
    one token per forward, the tokens transformers' greedy generate gives."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    ids = [5, 17, 3, 88, 41]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    argv = ["generate", str(tmp_path), "--prompt-ids", "5,17,3,88,41", "--max-new-tokens", "6"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "q_norm" not in captured.err
    got = [int(t) for t in captured.out.strip().strip("[]").split(",") if t.strip()]
    # generate stops at EOS; transformers' random model may not, so compare the prefix.
    assert got == want[0, len(ids) : len(ids) + len(got)].tolist() and got
