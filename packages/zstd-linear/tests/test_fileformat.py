"""save_compressed / load_compressed and the .zlin format's failure modes."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import make_toy

from zstd_linear import (
    FORMAT_VERSION,
    CompressedFileError,
    compress_model,
    compressed_layers,
    load_compressed,
    read_file,
    save_compressed,
)
from zstd_linear.fileformat import MAGIC


@pytest.fixture
def saved(tmp_path):
    model = make_toy(seed=3)
    compress_model(model)
    path = tmp_path / "toy.zlin"
    save_compressed(model, path)
    return path


def data_start(path) -> int:
    raw = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", raw, 12)
    return 24 + header_len


def header(path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[24 : data_start(path)])


def test_round_trip_restores_every_layer_by_its_full_name(saved, tmp_path):
    plain, fresh = make_toy(seed=3), make_toy(seed=99)  # fresh: other weights, same shapes
    report = load_compressed(saved, fresh, policy="per_pass")
    assert len(report.layers) == 9
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(fresh(x), plain(x))
    for name, layer in compressed_layers(fresh).items():
        assert torch.equal(layer.weight, plain.get_submodule(name).weight)
    assert [p.name for p in tmp_path.iterdir()] == ["toy.zlin"]  # no temp file left


def test_header_documents_names_and_frames(saved):
    h = header(saved)
    assert h["format"] == FORMAT_VERSION == 2
    assert [lyr["name"] for lyr in h["layers"]][:3] == [
        "blocks.0.q_proj",
        "blocks.0.up_proj",
        "blocks.0.down_proj",
    ]
    assert h["layers"][0]["bias"] is not None and h["layers"][1]["bias"] is None


def test_truncation_anywhere_fails_naming_a_layer_or_the_prefix(saved, tmp_path):
    raw = saved.read_bytes()
    start = data_start(saved)
    last_name = header(saved)["layers"][-1]["name"]
    for cut in (len(raw) - 1, start + (len(raw) - start) // 2):
        bad = tmp_path / "cut.zlin"
        bad.write_bytes(raw[:cut])
        with pytest.raises(CompressedFileError, match=r"layer '.*' in .*truncated"):
            read_file(bad)
    bad.write_bytes(raw[:-1])
    with pytest.raises(CompressedFileError, match=f"layer '{last_name}'"):
        read_file(bad)
    for cut in (0, 10, 30):
        bad.write_bytes(raw[:cut])
        with pytest.raises(CompressedFileError, match="truncated"):
            read_file(bad)


def test_corrupted_frame_fails_naming_its_layer(saved, tmp_path):
    h = header(saved)
    layer = h["layers"][4]
    offset = data_start(saved) + layer["frames"][-1][0]
    raw = bytearray(saved.read_bytes())
    raw[offset + 3] ^= 0x10
    bad = tmp_path / "flip.zlin"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CompressedFileError, match=f"layer '{layer['name']}'.*checksum"):
        read_file(bad)


def test_corrupted_header_and_other_files_are_rejected(saved, tmp_path):
    raw = bytearray(saved.read_bytes())
    bad = tmp_path / "bad.zlin"
    flipped = bytearray(raw)
    flipped[30] ^= 1
    bad.write_bytes(bytes(flipped))
    with pytest.raises(CompressedFileError, match="header checksum"):
        read_file(bad)
    bad.write_bytes(b"PK\x03\x04" + bytes(raw[4:]))
    with pytest.raises(CompressedFileError, match="not a zstd-linear file"):
        read_file(bad)
    bad.write_bytes(MAGIC + struct.pack("<I", 7) + bytes(raw[12:]))
    with pytest.raises(CompressedFileError, match="format version 7"):
        read_file(bad)


def test_file_for_other_shapes_or_modules_is_rejected_and_model_unchanged(saved):
    other = make_toy(dim=16)
    with pytest.raises(
        ValueError, match=r"layer 'blocks.0.q_proj' .* shape \(32, 32\), the model's is \(16, 16\)"
    ):
        load_compressed(saved, other)
    assert type(other.blocks[0].q_proj) is torch.nn.Linear
    fewer = make_toy()
    fewer.blocks = fewer.blocks[:1]
    with pytest.raises(ValueError, match=r"layer 'blocks\.1\.q_proj' .* found nothing"):
        load_compressed(saved, fewer)
    halfs = make_toy(dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype float32"):
        load_compressed(saved, halfs)


def test_failed_write_keeps_the_old_file(saved, monkeypatch):
    model = make_toy(seed=5)
    compress_model(model)
    before = saved.read_bytes()

    def boom(*args):
        raise OSError("disk full")

    monkeypatch.setattr("zstd_linear.fileformat.os.fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save_compressed(model, saved)
    assert saved.read_bytes() == before
    assert [p.name for p in saved.parent.iterdir()] == ["toy.zlin"]
