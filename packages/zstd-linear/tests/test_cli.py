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
