"""The .zlin JSON header: strict parsing and a check of every field before it is used.

A header whose CRC matches can still be wrong (written by other code, or edited and
re-checksummed), so nothing in it is trusted: the JSON is strict (no NaN, no duplicate
keys), every object has exactly its keys, every integer is an int (not a bool or a
float) in range, names come from the registries, shapes agree with the frame count
and the raw frame sizes, and the frames and biases tile the data section exactly (inside
it, no overlap, no gap, nothing after). Only then is any byte of the data section read.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass

from zstd_linear.codec import FRAME_KINDS
from zstd_linear.errors import CompressedFileError
from zstd_linear.layout import LAYOUTS, SUPPORTED_DTYPES

LAYER_KEYS = frozenset(
    {"name", "dtype", "shape", "layout", "level", "chunk_elems", "frames", "bias", "weight_crc32"}
)
BIAS_KEYS = frozenset({"dtype", "offset", "length", "crc32"})
MAX_DIM = 2**31  # per dimension of a weight: far above any Linear, far below overflow
MAX_CHUNK_ELEMS = 2**40
MAX_OFFSET = 2**63  # offsets and lengths; the tiling check then holds them to the file
# A zstd frame expands at most 32768x: its densest block, RLE, takes 4 bytes (3 of
# header, 1 of content) for at most 128 KiB.
ZSTD_MAX_EXPANSION = 32768


def fail(path, layer: str | None, message: str) -> CompressedFileError:
    where = f"layer {layer!r} in " if layer else ""
    return CompressedFileError(f"{where}{path}: {message}")


def record_crc32(data_crc: int, name: str, role: str, dtype: str, shape) -> int:
    """The CRC-32 a .zlin file records for a tensor: of its bytes followed by
    ``name \\0 role \\0 dtype \\0 d0,d1``, so that a record moved to another layer, or
    the same bytes read as another dtype or shape, no longer matches."""
    tag = f"{name}\0{role}\0{dtype}\0{','.join(str(d) for d in shape)}"
    return zlib.crc32(tag.encode(), data_crc)


@dataclass(frozen=True)
class FrameSpec:
    offset: int
    length: int
    kind: str  # a codec.FRAME_KINDS name
    crc32: int
    size: int  # the plane's decoded bytes


@dataclass(frozen=True)
class BiasSpec:
    dtype: str
    offset: int
    length: int
    crc32: int


@dataclass(frozen=True)
class LayerSpec:
    name: str
    dtype: str
    shape: tuple[int, int]
    layout: str
    level: int
    chunk_elems: int
    frames: tuple[FrameSpec, ...]  # chunk-major, plane-minor
    bias: BiasSpec | None
    weight_crc32: int

    @property
    def n_planes(self) -> int:
        return LAYOUTS[self.layout].n_planes(self.dtype)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


def _no_constant(name: str):
    raise CompressedFileError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        keys = [k for k, _ in pairs]
        raise CompressedFileError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return obj


def parse_header(
    path: str | os.PathLike, raw: bytes, version: int, data_size: int
) -> list[LayerSpec]:
    """Every layer of the header ``raw``, checked against the data section's size."""
    try:
        header = json.loads(
            raw.decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_no_duplicates
        )
    except CompressedFileError as exc:  # from the two hooks: a duplicate key, a NaN
        raise fail(path, None, f"malformed header: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise fail(path, None, f"malformed header: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"format", "layers"}:
        shown = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise fail(path, None, f"header must be an object with keys format, layers, got {shown}")
    if type(header["format"]) is not int or header["format"] != version:
        raise fail(
            path,
            None,
            f"header field 'format' must be {version} (the prefix's version), "
            f"got {_show(header['format'])}",
        )
    if not isinstance(header["layers"], list):
        raise fail(
            path, None, f"header field 'layers' must be a list, got {_show(header['layers'])}"
        )
    layers = [_layer(path, i, obj, version) for i, obj in enumerate(header["layers"])]
    seen: set[str] = set()
    for layer in layers:
        if layer.name in seen:
            raise fail(path, layer.name, "the name appears twice in the header")
        seen.add(layer.name)
    _check_tiling(path, layers, data_size)
    return layers


def _layer(path, index: int, obj, version: int) -> LayerSpec:
    if not isinstance(obj, dict):
        raise fail(path, None, f"header layer {index} must be an object, got {_show(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise fail(
            path,
            None,
            f"header layer {index}: 'name' must be a non-empty string, got {_show(name)}",
        )
    if set(obj) != LAYER_KEYS:
        missing, extra = sorted(LAYER_KEYS - set(obj)), sorted(set(obj) - LAYER_KEYS)
        raise fail(path, name, f"layer entry keys: missing {missing}, unknown {extra}")

    def bad(field: str, expected: str):
        return fail(path, name, f"field {field!r} must be {expected}, got {_show(obj[field])}")

    dtype, layout, shape = obj["dtype"], obj["layout"], obj["shape"]
    if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
        raise bad("dtype", f"one of {sorted(SUPPORTED_DTYPES)}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise bad("layout", f"one of {sorted(LAYOUTS)}")
    if not (
        isinstance(shape, list) and len(shape) == 2 and all(_is_int(d, 0, MAX_DIM) for d in shape)
    ):
        raise bad("shape", f"[out_features, in_features], ints in 0..{MAX_DIM}")
    if not _is_int(obj["level"], 1, 22):
        raise bad("level", "an int in 1..22")
    if not _is_int(obj["chunk_elems"], 1, MAX_CHUNK_ELEMS):
        raise bad("chunk_elems", f"an int in 1..{MAX_CHUNK_ELEMS}")
    if not _is_int(obj["weight_crc32"], 0, 2**32 - 1):
        raise bad("weight_crc32", "a CRC-32 (an int in 0..2**32-1)")
    out_features, in_features = shape
    numel, chunk_elems = out_features * in_features, obj["chunk_elems"]
    itemsize = SUPPORTED_DTYPES[dtype][1].itemsize
    n_planes = LAYOUTS[layout].n_planes(dtype)
    n_chunks = max(1, -(-numel // chunk_elems))
    frames = obj["frames"]
    if not isinstance(frames, list) or len(frames) != n_chunks * n_planes:
        count = len(frames) if isinstance(frames, list) else _show(frames)
        raise fail(
            path,
            name,
            f"field 'frames' must list {n_chunks} chunks x {n_planes} planes = "
            f"{n_chunks * n_planes} frames for shape {shape}, got {count}",
        )
    specs = []
    max_kind = 1 if version == 2 else len(FRAME_KINDS) - 1  # version 2: zstd and raw only
    for k, frame in enumerate(frames):
        if not (
            isinstance(frame, list)
            and len(frame) == 4
            and _is_int(frame[0], 0, MAX_OFFSET)
            and _is_int(frame[1], 0, MAX_OFFSET)
            and _is_int(frame[2], 0, max_kind)
            and _is_int(frame[3], 0, 2**32 - 1)
        ):
            kinds = ", ".join(f"{i} {kind}" for i, kind in enumerate(FRAME_KINDS[: max_kind + 1]))
            raise fail(
                path,
                name,
                f"frame {k} must be [offset, length, kind ({kinds}), crc32] of ints, offset "
                f"and length >= 0, got {_show(frame)}",
            )
        offset, length, kind, crc = frame
        kind = FRAME_KINDS[kind]
        c = k // n_planes
        elems = min(chunk_elems, numel - c * chunk_elems)
        size = elems * (itemsize if n_planes == 1 else 1)
        # A bit-packed plane keeps 1..7 bits of each byte after its 2-byte mask and
        # value; its exact length depends on the mask (checked when the frame is read).
        low, high = 2 + -(-size // 8), 2 + -(-7 * size // 8)
        if kind == "bitpack" and not low <= length <= high:
            raise fail(
                path,
                name,
                f"frame {k} (chunk {c}) is bit-packed, so it must hold {low} to {high} "
                f"bytes for {size}, not {length}",
            )
        if kind == "raw" and length != size:
            raise fail(
                path,
                name,
                f"frame {k} (chunk {c}) is raw, so it must hold {size} bytes, not {length}",
            )
        if kind == "zstd" and size > ZSTD_MAX_EXPANSION * length:
            raise fail(
                path,
                name,
                f"frame {k} (chunk {c}) of {length} bytes cannot decode to {size} bytes "
                f"(a zstd frame expands at most {ZSTD_MAX_EXPANSION}x)",
            )
        specs.append(FrameSpec(offset, length, kind, crc, size))
    return LayerSpec(
        name=name,
        dtype=dtype,
        shape=(out_features, in_features),
        layout=layout,
        level=obj["level"],
        chunk_elems=chunk_elems,
        frames=tuple(specs),
        bias=_bias(path, name, obj["bias"], out_features),
        weight_crc32=obj["weight_crc32"],
    )


def _bias(path, name: str, bias, out_features: int) -> BiasSpec | None:
    if bias is None:
        return None
    if not isinstance(bias, dict) or set(bias) != BIAS_KEYS:
        raise fail(
            path,
            name,
            f"field 'bias' must be null or an object with keys {sorted(BIAS_KEYS)}, got {_show(bias)}",
        )
    dtype = bias["dtype"]
    if not isinstance(dtype, str) or dtype not in SUPPORTED_DTYPES:
        raise fail(
            path, name, f"bias dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {_show(dtype)}"
        )
    length = out_features * SUPPORTED_DTYPES[dtype][1].itemsize
    if not (
        _is_int(bias["offset"], 0, MAX_OFFSET)
        and bias["length"] == length
        and type(bias["length"]) is int
        and _is_int(bias["crc32"], 0, 2**32 - 1)
    ):
        raise fail(
            path,
            name,
            f"bias must have an int offset >= 0, length {length} "
            f"({out_features} x {dtype}) and a crc32, got {_show(bias)}",
        )
    return BiasSpec(dtype, bias["offset"], length, bias["crc32"])


def _check_tiling(path, layers: list[LayerSpec], data_size: int) -> None:
    """The frames and biases must cover the data section exactly, back to back."""
    spans = []
    for layer in layers:
        spans += [(f.offset, f.length, layer.name, "a frame") for f in layer.frames]
        if layer.bias is not None:
            spans.append((layer.bias.offset, layer.bias.length, layer.name, "the bias"))
    end = 0
    for offset, length, name, what in sorted(spans):
        if length == 0:
            continue
        if offset != end:
            problem = (
                "overlaps the previous one" if offset < end else f"leaves a gap after byte {end}"
            )
            raise fail(
                path,
                name,
                f"{what} at bytes {offset}..{offset + length} of the data section {problem}",
            )
        end = offset + length
        if end > data_size:
            raise fail(
                path,
                name,
                f"truncated: {what} ends at byte {end} of the data section, which holds {data_size}",
            )
    if end != data_size:
        raise fail(
            path,
            None,
            f"{data_size - end} bytes after the last frame (the data section must end there)",
        )
