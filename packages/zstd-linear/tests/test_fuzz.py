"""Seeded mutants of a small .zlin file: every one is refused with a CompressedFileError
or loads the exact weights (membound_testing.fuzz; crashes and hangs are caught by
loading each batch in a fresh process)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import zlin_fuzz

from membound_testing import fuzz
from zstd_linear.codec import CodecConfig

HERE = Path(__file__).parent


def tiny_layers() -> dict:
    """Every dtype and layout, raw and zstd frames, one and several chunks, with and
    without bias: 22 KiB of weights."""
    g = torch.Generator().manual_seed(0)
    small = CodecConfig(chunk_bytes=4096)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=g).to(dtype)

    def coarse(*shape, dtype):  # few distinct values: zstd shrinks every plane
        return (torch.randint(-4, 4, shape, generator=g) / 8).to(dtype)

    return {
        "blocks.0.q_proj": (
            randn(64, 64, dtype=torch.float32),
            randn(64, dtype=torch.float32),
            small,
        ),
        "blocks.0.up_proj": (
            randn(48, 32, dtype=torch.bfloat16),
            None,
            CodecConfig(layout="exponent-mantissa", chunk_bytes=4096),
        ),
        "blocks.1.q_proj": (
            coarse(32, 32, dtype=torch.float16),
            randn(32, dtype=torch.float16),
            CodecConfig(layout="zstd", chunk_bytes=4096),
        ),
        "blocks.1.down_proj": (
            coarse(32, 64, dtype=torch.bfloat16),
            randn(32, dtype=torch.bfloat16),
            CodecConfig(),
        ),
    }


def test_fuzzed_zlin_files_are_refused_cleanly_or_load_exactly(tmp_path, monkeypatch):
    target = zlin_fuzz.write_target(tmp_path / "tiny", tiny_layers())
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    report = fuzz.run(
        [target], zlin_fuzz.CHECKER, zlin_fuzz.CLEAN_ERRORS, n=400, seed=15, batch=100
    )
    assert report.bad == {}, report.summary()
    # The mutants must reach the loader's checks, not only the prefix: most are refused,
    # and the structured half (header rewritten, CRC kept right) is refused too.
    assert report.counts["clean"] >= 300, report.summary()
