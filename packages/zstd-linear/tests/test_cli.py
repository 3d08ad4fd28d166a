"""The zstd-linear command line on a small safetensors checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import make_toy
from safetensors.torch import save_file

from zstd_linear import load_compressed
from zstd_linear.cli import main


@pytest.fixture
def checkpoint(tmp_path):
    model = make_toy(seed=7)
    path = tmp_path / "model.safetensors"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state["embed.weight"] = torch.randn(10, 32)
    save_file(state, str(path))
    return model, path


def test_compress_inspect_bench_and_load(checkpoint, tmp_path, capsys):
    model, path = checkpoint
    out = tmp_path / "model.zlin"
    assert main(["compress", str(path), str(out), "--exclude", "embed*", "--level", "1"]) == 0
    captured = capsys.readouterr()
    assert "9/9" in captured.err  # the progress bar
    assert "9 layers" in captured.out
    assert main(["inspect", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| blocks.2.down_proj | float32 | 32x64 |" in table and "total (9 layers)" in table
    assert main(["bench", str(out), "--threads", "2", "--repeats", "2"]) == 0
    assert "GB/s" in capsys.readouterr().out
    fresh = make_toy(seed=8)
    load_compressed(out, fresh)
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_errors_are_reported_not_raised(checkpoint, tmp_path, capsys):
    _, path = checkpoint
    bad = tmp_path / "bad.zlin"
    bad.write_bytes(b"nonsense")
    assert main(["inspect", str(bad)]) == 2
    assert "truncated" in capsys.readouterr().err
    assert main(["compress", str(path), str(tmp_path / "x.zlin"), "--include", "nope*"]) == 2
    assert "matches the filters" in capsys.readouterr().err
    assert main(["compress", str(tmp_path / "missing"), str(tmp_path / "x.zlin")]) == 2


def test_compress_a_model_directory_and_run_it_from_the_file_alone(tmp_path, capsys):
    """An HF directory (a tiny random Llama with SmolLM2's vocabulary and tokenizer) ->
    .zlin + companion -> ``run`` builds the model from the files and generates the plain
    model's greedy tokens."""
    from conftest import tiny_llama
    from transformers import AutoTokenizer

    from membound_testing import smollm2_float_dir

    plain = tiny_llama(seed=0, vocab_size=49152)
    src = tmp_path / "tiny"
    plain.save_pretrained(src)
    out = tmp_path / "tiny.zlin"
    capsys.readouterr()
    assert main(["compress", str(src), str(out), "--level", "1"]) == 0
    captured = capsys.readouterr()
    bars = [line for line in captured.err.split("\r") if line.startswith("compress [")]
    assert "0/15" in bars[0]  # drawn before the first layer is encoded
    assert "15/15" in captured.err  # 2 x 7 Linear + the embedding (lm_head tied to it)
    assert "tiny.zlin.safetensors" in captured.out
    tokenizer = smollm2_float_dir()
    prompt = "The capital of France is"
    argv = ["run", str(out), "--prompt", prompt, "--max-new-tokens", "5"]
    assert main([*argv, "--tokenizer", str(tokenizer)]) == 0
    generated = capsys.readouterr().out.strip()
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    ids = tok(prompt, return_tensors="pt")
    with torch.inference_mode():
        ref = plain.generate(**ids, max_new_tokens=5, do_sample=False)
    expected = tok.decode(ref[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert generated == expected.strip()
    # The source was recorded, so --tokenizer is optional; it is the directory, which
    # has no tokenizer here: a clear error, not a traceback.
    assert main(argv) == 2
    assert "zstd-linear: error: " in capsys.readouterr().err


@pytest.mark.parametrize("command", ["compress", "run", "inspect", "bench"])
def test_help_shows_every_default(command, capsys, monkeypatch):
    import re

    from zstd_linear.cli import build_parser

    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    # One entry per option: from its "  --name" line to the next option's.
    parts = re.split(r"\n(?=  -)", out.split("options:")[1])
    entries = {e.split()[0].rstrip(","): " ".join(e.split()) for e in parts if e.strip()}
    for action in options:
        entry = entries[action.option_strings[0]]
        assert action.help, action.option_strings  # nothing undocumented
        if action.required or action.default in (None, []):
            assert "(default: None)" not in entry and "(default: [])" not in entry, entry
        else:
            assert f"(default: {action.default})" in entry, entry
    if command == "compress":
        assert "(default: auto)" in out and "(default: 3)" in out
    if command == "run":
        assert "(default: per_pass_prefetch)" in out


def test_choices_come_from_the_registries():
    from zstd_linear import POLICIES
    from zstd_linear.cli import build_parser
    from zstd_linear.layout import LAYOUTS

    commands = build_parser()._subparsers._group_actions[0].choices
    layout = next(a for a in commands["compress"]._actions if a.dest == "layout")
    policy = next(a for a in commands["run"]._actions if a.dest == "policy")
    assert list(layout.choices) == ["auto", *sorted(LAYOUTS)]
    assert list(policy.choices) == sorted(POLICIES)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A whole tiny Llama saved as .zlin + companion."""
    from conftest import tiny_llama

    from zstd_linear import compress_model, save_compressed

    model = tiny_llama()
    compress_model(model, level=1, embeddings=True)
    path = tmp_path_factory.mktemp("saved") / "tiny.zlin"
    save_compressed(model, path)
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compress", "notes.txt", "o.zlin"], "notes.txt is not a safetensors file"),
        (["compress", "junk.gguf", "o.zlin"], "not a GGUF file"),
        (["compress", "missing", "o.zlin"], "no such model directory or file: 'missing'"),
        (["run", "missing.zlin", "--prompt", "hi"], "no such .zlin file: 'missing.zlin'"),
        (["run", "damaged.zlin", "--prompt", "hi"], "damaged.zlin: truncated"),
        (["run", "notes.txt", "--prompt", "hi"], "no notes.txt.safetensors beside it"),
        (["inspect", "damaged.zlin"], "damaged.zlin: truncated"),
        (["inspect", "missing.zlin"], "No such file or directory: 'missing.zlin'"),
        (["bench", "flipped.zlin"], "flipped.zlin"),
    ],
)
def test_expected_errors_are_one_line_with_exit_status_2(
    argv, message, saved_tiny, tmp_path, capsys, monkeypatch
):
    """A non-model file, a missing one, a damaged .zlin: ``zstd-linear: error: ...``."""
    import shutil

    from zstd_linear.pretrained import companion_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("Not a model.\n")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    data = saved_tiny.read_bytes()
    (tmp_path / "damaged.zlin").write_bytes(data[: len(data) // 2])
    shutil.copy(companion_path(saved_tiny), "damaged.zlin.safetensors")
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF  # inside the last frame or bias
    (tmp_path / "flipped.zlin").write_bytes(bytes(flipped))
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("zstd-linear")]
    assert len(lines) == 1 and lines[0].startswith("zstd-linear: error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "o.zlin").exists()
