"""The command line's convention (#19): build_parser/cmd_*, defaults and registry choices in
--help, expected errors as `paired-cache: error: <message>` with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paired_cache import MASK_SOURCES
from paired_cache.cli import build_parser, main


def test_help_shows_defaults_and_registry_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ask", "--help"])
    out = capsys.readouterr().out
    assert "(default: 0.5)" in out, out
    assert "{" + ",".join(sorted(MASK_SOURCES)) + "}" in out, out
    assert "(default: cats)" in out and "(default: 16)" in out
    assert "{copy,in_place}" in out and "{sparse,dense}" in out, out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit-predictor", "--help"])
    # One predictor file serves every --fraction of ask: fit-predictor takes none.
    out = capsys.readouterr().out
    assert "(default: gated 64, linear 128)" in out and "--fraction" not in out, out
    assert "(default: gated)" in out and "(default: None)" not in out, out


def test_an_unknown_source_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ask", "m", "p.pcpool", "hi", "--source", "topk"])
    assert exit_.value.code == 2
    assert "invalid choice: 'topk'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["lots", "-1", "1.5"])
def test_ask_refuses_a_bad_keep_cached(capsys, bad):
    with pytest.raises(SystemExit) as exit_:
        main(["ask", "m", "p.pcpool", "hi", "--keep-cached", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--keep-cached: 'auto', 'none' or a byte count >= 0, got {bad!r}" in err, err


def test_ask_keep_cached_takes_auto_none_and_bytes():
    parse = build_parser().parse_args
    base = ["ask", "m", "p.pcpool", "hi"]
    assert parse(base).keep_cached == "auto"
    assert parse([*base, "--keep-cached", "none"]).keep_cached is None
    assert parse([*base, "--keep-cached", "123"]).keep_cached == 123


def _expect_error(argv, capsys, *needles):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("paired-cache: error: "), captured.err
    assert "Traceback" not in captured.err
    for needle in needles:
        assert needle in captured.err, captured.err


def test_missing_model_paths(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    out = str(tmp_path / "out.pcpool")
    _expect_error(["convert", missing, out], capsys, "nowhere does not exist")
    _expect_error(["fit-predictor", missing, __file__, out], capsys, "nowhere does not exist")
    _expect_error(["ask", missing, out, "hi"], capsys, "nowhere does not exist: load_sparse")
    assert list(tmp_path.iterdir()) == []


def test_files_that_are_no_model(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n")
    fake_st = tmp_path / "fake.safetensors"
    fake_st.write_bytes(b"\xff" * 64)
    fake_dir = tmp_path / "dir"
    fake_dir.mkdir()
    out = str(tmp_path / "out.pcpool")
    _expect_error(["convert", str(text), out], capsys, "expected a .safetensors file")
    _expect_error(["convert", str(fake_st), out], capsys, "fake.safetensors")
    _expect_error(["convert", str(fake_dir), out], capsys, "expected a .safetensors file")
    _expect_error(["fit-predictor", str(text), str(text), out], capsys, "expected a model dir")
    _expect_error(["ask", str(fake_dir), str(text), "hi"], capsys, "dir holds no config.json")
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_text("not a model\n")
    _expect_error(["convert", str(fake_gguf), out], capsys, "fake.gguf")
    fake_gguf.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "fake.safetensors", "notes.txt"]


def test_the_installed_script_prints_no_traceback(tmp_path):
    script = Path(sys.executable).parent / "paired-cache"
    result = subprocess.run(
        [str(script), "convert", str(tmp_path / "missing"), str(tmp_path / "x.pcpool")],
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("paired-cache: error: "), result.stderr
    assert "Traceback" not in result.stderr
