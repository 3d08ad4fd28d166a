"""save_compressed / load_compressed and the .zlin format's failure modes."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from conftest import make_toy
from zlin_fuzz import PREFIX, join, split

from zstd_linear import CompressedFileError, compress_model, load_compressed, save_compressed
from zstd_linear.decoder import DecodeError
from zstd_linear.fileformat import FORMAT_VERSION, MAGIC, read_file
from zstd_linear.model import compressed_layers


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
    kinds = {f[2] for layer in h["layers"] for f in layer["frames"]}
    assert h["format"] == (3 if 2 in kinds else 2) and FORMAT_VERSION == 3
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
    with pytest.raises(CompressedFileError, match=r"layer 'blocks\.1\.q_proj' .* found nothing"):
        load_compressed(saved, fewer)
    halfs = make_toy(dtype=torch.float16)
    with pytest.raises(CompressedFileError, match="dtype float32"):
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


# Issue #15: headers rewritten with their CRC recomputed, so the field checks are tested.


def rewrite(path, tmp_path, edit) -> str:
    """A copy of ``path`` whose header ``edit(header)`` changed (in place or returned),
    with the header's length and CRC-32 recomputed."""
    version, h, body = split(path.read_bytes())
    h = edit(h) or h
    bad = tmp_path / "crafted.zlin"
    bad.write_bytes(join(version, h, body))
    return bad


def raw_header(path, tmp_path, raw: bytes) -> str:
    version, _, body = split(path.read_bytes())
    bad = tmp_path / "crafted.zlin"
    bad.write_bytes(PREFIX.pack(MAGIC, version, len(raw), zlib.crc32(raw)) + raw + body)
    return bad


def test_a_file_written_by_0_4_loads_bit_exact():
    # tests/data/toy-bf16-0.4.0.zlin: make_toy(seed=11, dim=64, dtype=bfloat16) compressed
    # and saved by zstd-linear 0.4.0, whose default layout for bfloat16 was "exponent".
    path = Path(__file__).parent / "data" / "toy-bf16-0.4.0.zlin"
    assert {encoded.layout for _, encoded, _ in read_file(path)} == {"exponent"}
    original = make_toy(seed=11, dim=64, dtype=torch.bfloat16)
    model = make_toy(seed=0, dim=64, dtype=torch.bfloat16)
    load_compressed(path, model)
    for name, layer in compressed_layers(model).items():
        plain = original.get_submodule(name).weight
        assert torch.equal(layer.weight.view(torch.int16), plain.view(torch.int16)), name


def test_swapped_layout_is_refused_not_decoded_to_another_weight(saved, tmp_path):
    # The reproducer: the frame CRCs cover the compressed bytes, so a file whose
    # layout field alone changed decoded to a different weight without a word.
    def edit(h):
        h["layers"][1]["layout"] = "exponent-mantissa"  # was "exponent": same 4 planes

    with pytest.raises(
        CompressedFileError,
        match=r"layer 'blocks.0.up_proj' in .*crafted.zlin: the decoded weight does not match",
    ):
        load_compressed(rewrite(saved, tmp_path, edit), make_toy())


def test_same_size_dtype_names_and_records_that_moved_are_refused(tmp_path):
    model = make_toy(seed=4, dtype=torch.bfloat16)
    compress_model(model)
    path = tmp_path / "bf16.zlin"
    save_compressed(model, path)

    def as_float16(h):
        h["layers"][2]["dtype"] = "float16"

    with pytest.raises(CompressedFileError, match=r"'blocks.0.down_proj'.*decoded weight"):
        read_file(rewrite(path, tmp_path, as_float16))

    def swap_names(h):  # two (64, 32) layers without bias
        a, b = h["layers"][1], h["layers"][4]
        a["name"], b["name"] = b["name"], a["name"]

    with pytest.raises(CompressedFileError, match=r"'blocks.1.up_proj'.*decoded weight"):
        read_file(rewrite(path, tmp_path, swap_names))

    def swap_biases(h):
        h["layers"][0]["bias"], h["layers"][3]["bias"] = (
            h["layers"][3]["bias"],
            h["layers"][0]["bias"],
        )

    with pytest.raises(
        CompressedFileError, match=r"'blocks.0.q_proj'.*checksum mismatch in the bfloat16 bias"
    ):
        read_file(rewrite(path, tmp_path, swap_biases))


def _set(*keys, value):
    def edit(h):
        obj = h
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # Each of these ended in AttributeError, TypeError or OverflowError before.
        (_set("layers", value={"a": 1}), r"field 'layers' must be a list"),
        (_set("layers", 0, value="blocks.0.q_proj"), r"header layer 0 must be an object"),
        (
            _set("layers", 0, "bias", value=[1, 2]),
            r"'blocks.0.q_proj'.*field 'bias' must be null or",
        ),
        (_set("layers", 0, "shape", value=[32.0, 32]), r"'blocks.0.q_proj'.*field 'shape'"),
        (_set("layers", 0, "shape", value=[2**64, 32]), r"'blocks.0.q_proj'.*field 'shape'"),
        (_set("layers", 0, "shape", value=[32]), r"'blocks.0.q_proj'.*field 'shape'"),
        (_set("layers", 0, "level", value=True), r"field 'level' must be an int in 1..22"),
        (_set("layers", 0, "chunk_elems", value=0), r"field 'chunk_elems'"),
        (_set("layers", 0, "chunk_elems", value=1), r"must list 1024 chunks x 4 planes"),
        (_set("layers", 0, "dtype", value=["float32"]), r"field 'dtype' must be one of"),
        (_set("layers", 0, "dtype", value="int32"), r"field 'dtype' must be one of"),
        (_set("layers", 0, "layout", value={}), r"field 'layout' must be one of"),
        (_set("layers", 0, "frames", value=None), r"field 'frames' must list 1 chunks x 4 planes"),
        (_set("layers", 0, "frames", 0, value=[0, 10]), r"frame 0 must be \[offset, length"),
        (_set("layers", 0, "frames", 0, 2, value=True), r"frame 0 must be \[offset, length"),
        (_set("layers", 0, "frames", 0, 0, value=-1), r"frame 0 must be \[offset, length"),
        (_set("layers", 0, "weight_crc32", value=2**32), r"field 'weight_crc32' must be a CRC-32"),
        (_set("layers", 0, "unknown", value=1), r"unknown \['unknown'\]"),
        (_set("layers", 0, "name", value=7), r"header layer 0: 'name' must be a non-empty string"),
        (_set("layers", 1, "name", value="blocks.0.q_proj"), r"the name appears twice"),
        (_set("layers", 0, "bias", "length", value=4096), r"bias must have .*length 128"),
        (_set("format", value="2"), r"header field 'format' must be [23] \(the prefix's version\)"),
        (_set("layers", 1, "frames", 0, 0, value=0), r"'blocks.0.up_proj'.*overlaps"),
    ],
)
def test_crafted_header_fields_are_refused_naming_the_field(saved, tmp_path, edit, message):
    with pytest.raises(CompressedFileError, match=message):
        load_compressed(rewrite(saved, tmp_path, edit), make_toy())


def test_frames_of_the_wrong_kind_or_size_are_refused(saved, tmp_path):
    h = header(saved)
    raw_k = next(k for k, f in enumerate(h["layers"][0]["frames"]) if f[2] == 1)
    packed_k = next(k for k, f in enumerate(h["layers"][0]["frames"]) if f[2] == 0)
    with pytest.raises(
        CompressedFileError, match=rf"frame {raw_k} must decode to 1024 bytes, found no zstd"
    ):
        read_file(rewrite(saved, tmp_path, _set("layers", 0, "frames", raw_k, 2, value=0)))
    with pytest.raises(
        CompressedFileError, match=rf"frame {packed_k} \(chunk 0\) is raw, so it must hold 1024"
    ):
        read_file(rewrite(saved, tmp_path, _set("layers", 0, "frames", packed_k, 2, value=1)))


@pytest.fixture
def saved_bf16(tmp_path):
    """A bfloat16 toy under the default layout: its low planes are bit-packed."""
    model = make_toy(seed=4, dtype=torch.bfloat16)
    compress_model(model)
    path = tmp_path / "bf16.zlin"
    save_compressed(model, path)
    return path


def test_bit_packed_frames_make_a_version_3_file_and_none_a_version_2_one(saved_bf16, tmp_path):
    version, h, _ = split(saved_bf16.read_bytes())
    kinds = [f[2] for layer in h["layers"] for f in layer["frames"]]
    assert version == h["format"] == 3 and 2 in kinds
    original = make_toy(seed=4, dtype=torch.bfloat16)
    model = make_toy(seed=0, dtype=torch.bfloat16)
    load_compressed(saved_bf16, model)
    for name, layer in compressed_layers(model).items():
        plain = original.get_submodule(name).weight
        assert torch.equal(layer.weight.view(torch.int16), plain.view(torch.int16)), name
    # Without bit-packed frames the file stays version 2, which zstd-linear 0.6 reads.
    model = make_toy(seed=4, dtype=torch.bfloat16)
    compress_model(model, layout="exponent")
    path = tmp_path / "v2.zlin"
    save_compressed(model, path)
    version, h, _ = split(path.read_bytes())
    assert version == h["format"] == 2
    assert {f[2] for layer in h["layers"] for f in layer["frames"]} == {0, 1}
    read_file(path)


def test_bit_packed_frames_are_checked_before_decoding(saved_bf16, tmp_path):
    version, h, body = split(saved_bf16.read_bytes())
    layer = h["layers"][1]
    k, frame = next((k, f) for k, f in enumerate(layer["frames"]) if f[2] == 2)
    offset, length = frame[0], frame[1]
    # a version 2 header cannot hold kind 2
    bad = tmp_path / "v2-kind.zlin"
    bad.write_bytes(join(2, dict(h, format=2), body))
    with pytest.raises(
        CompressedFileError, match=r"frame \d+ must be \[offset, length, kind \(0 zstd, 1 raw\)"
    ):
        read_file(bad)
    # nor can any reader take a version it does not know
    bad.write_bytes(join(4, dict(h, format=4), body))
    with pytest.raises(
        CompressedFileError, match="format version 4, this reader reads versions 2 and 3"
    ):
        read_file(bad)
    # a length no packing of the plane can have
    with pytest.raises(
        CompressedFileError,
        match=rf"frame {k} \(chunk 0\) is bit-packed, so it must hold 258 to 1794 bytes for 2048, not 1",
    ):
        read_file(rewrite(saved_bf16, tmp_path, _set("layers", 1, "frames", k, 1, value=1)))
    # a mask that does not match the frame's length, and a constant outside the mask,
    # with the frame's CRC-32 recomputed (a file written by other code)
    for first_two in (b"\x03\x00", b"\x01\x02", b"\x00\x00", b"\xff\x00"):
        patched = body[:offset] + first_two + body[offset + 2 :]
        h2 = json.loads(json.dumps(h))
        h2["layers"][1]["frames"][k][3] = zlib.crc32(patched[offset : offset + length])
        bad.write_bytes(join(version, h2, patched))
        with pytest.raises(CompressedFileError, match=rf"frame {k} is not a bit-packed plane"):
            read_file(bad)


def test_malformed_json_deep_nesting_and_foreign_constants_are_refused(saved, tmp_path):
    for raw, message in [
        (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
        (b'{"format": 2, "format": 2, "layers": []}', "duplicate key 'format'"),
        (b'{"format": 2, "layers": [], "x": NaN}', "NaN is not valid JSON"),
        (b"\xff\xfe", "UnicodeDecodeError"),
        (b"[]", "must be an object with keys format, layers"),
    ]:
        with pytest.raises(CompressedFileError, match=f"malformed header.*{message}|{message}"):
            read_file(raw_header(saved, tmp_path, raw))


def test_trailing_bytes_gaps_and_oversized_header_lengths_are_refused(saved, tmp_path):
    raw = saved.read_bytes()
    bad = tmp_path / "bad.zlin"
    bad.write_bytes(raw + b"junk")
    with pytest.raises(CompressedFileError, match="4 bytes after the last frame"):
        read_file(bad)
    version, h, body = split(raw)
    h["layers"].pop(4)  # a layer in the middle: its frames are left as a gap
    bad.write_bytes(join(version, h, body))
    with pytest.raises(CompressedFileError, match="leaves a gap"):
        read_file(bad)
    for header_len in (len(raw), 2**63):
        bad.write_bytes(raw[:12] + struct.pack("<Q", header_len) + raw[20:])
        with pytest.raises(
            CompressedFileError, match=f"a header of {header_len} bytes does not fit"
        ):
            read_file(bad)


def test_version_1_files_are_refused_with_a_way_forward(saved, tmp_path):
    _, h, body = split(saved.read_bytes())
    h["format"] = 1
    bad = tmp_path / "v1.zlin"
    bad.write_bytes(join(1, h, body))
    with pytest.raises(CompressedFileError, match=r"format version 1 .* re-compress the model"):
        read_file(bad)


def test_model_mismatches_and_decode_errors_are_the_package_error(saved):
    assert issubclass(DecodeError, CompressedFileError) and issubclass(
        CompressedFileError, ValueError
    )
    with pytest.raises(CompressedFileError, match="shape"):
        load_compressed(saved, make_toy(dim=16))
    other_bias = make_toy()
    other_bias.blocks[0].q_proj.bias.data = other_bias.blocks[0].q_proj.bias.data.double()
    with pytest.raises(
        CompressedFileError, match=r"'blocks.0.q_proj' .* float32 bias, the model's is float64"
    ):
        load_compressed(saved, other_bias)
    assert type(other_bias.blocks[0].q_proj) is torch.nn.Linear


def test_loaded_file_saves_back_byte_identical(saved, tmp_path):
    fresh = make_toy(seed=7)
    load_compressed(saved, fresh)
    again = tmp_path / "again.zlin"
    save_compressed(fresh, again)
    assert again.read_bytes() == saved.read_bytes()


def test_frames_that_could_not_expand_to_the_declared_shape_are_refused(tmp_path):
    model = make_toy()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            # bytes alternating 0x00 and 0xFF: every bit varies (nothing to bit-pack), and
            # every plane is a tiny zstd frame
            module.weight.data.view(torch.int32).copy_(
                torch.tensor([0, -1], dtype=torch.int32)
                .repeat(module.weight.numel() // 2)
                .view_as(module.weight)
            )
    compress_model(model)
    path = tmp_path / "zeros.zlin"
    save_compressed(model, path)

    def huge(h):  # one chunk of 2**40 elements: 1 TiB per plane from a few bytes
        h["layers"][0]["shape"] = [2**20, 2**20]
        h["layers"][0]["chunk_elems"] = 2**40

    with pytest.raises(
        CompressedFileError, match=r"frame 0 \(chunk 0\) of \d+ bytes cannot decode"
    ):
        read_file(rewrite(path, tmp_path, huge))
