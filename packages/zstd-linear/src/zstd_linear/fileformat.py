"""The ``.zlin`` file: compressed Linear layers keyed by fully qualified name.

Layout (all integers little-endian)::

    magic        8 bytes   b"ZSTDLIN\\0"
    version      u32       FORMAT_VERSION
    header_len   u64       bytes of the JSON header
    header_crc   u32       zlib.crc32 of the header bytes
    header       JSON      {"format": 1, "layers": [layer, ...]}
    data                   frames and biases, back to back

    layer = {"name": fully qualified module name, "dtype": "float32" | "bfloat16" |
             "float16", "shape": [out, in], "layout": LAYOUTS name, "level": int,
             "chunk_elems": int,
             "frames": [[offset, length, raw (0/1), crc32], ...]   # chunk-major, plane-minor
             "bias": null | {"dtype", "offset", "length", "crc32"}}

Offsets are relative to the start of ``data``. Every size is checked against the
file before anything is allocated, and every frame's CRC-32 before it is used, so
a truncated or corrupted file fails with a CompressedFileError naming the layer.
Files are written to a temporary name in the target directory and renamed.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

from zstd_linear.codec import EncodedWeight, Frame
from zstd_linear.layout import LAYOUTS, SUPPORTED_DTYPES

MAGIC = b"ZSTDLIN\0"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQI")  # magic, version, header_len, header_crc


class CompressedFileError(ValueError):
    """A .zlin file is truncated, corrupted, of another version, or malformed."""


Entry = tuple[str, EncodedWeight, "torch.Tensor | None"]


def write_file(path: str | os.PathLike, entries: list[Entry]) -> None:
    """Write ``entries`` (name, encoded weight, bias (out,) or None) atomically."""
    path = Path(path)
    blobs: list[bytes] = []
    offset = 0
    layers = []

    def put(data: bytes) -> list[int]:
        nonlocal offset
        blobs.append(data)
        start, offset = offset, offset + len(data)
        return [start, len(data), zlib.crc32(data)]

    for name, encoded, bias in entries:
        frames = []
        for chunk in encoded.frames:
            for frame in chunk:
                start, length, crc = put(frame.data)
                frames.append([start, length, int(frame.raw), crc])
        bias_entry = None
        if bias is not None:
            b = bias.detach().to("cpu").contiguous()
            start, length, crc = put(
                b.view(-1).view(torch.uint8).numpy().tobytes() if b.numel() else b""
            )
            bias_entry = {
                "dtype": str(b.dtype).removeprefix("torch."),
                "offset": start,
                "length": length,
                "crc32": crc,
            }
        layers.append(
            {
                "name": name,
                "dtype": encoded.dtype,
                "shape": list(encoded.shape),
                "layout": encoded.layout,
                "level": encoded.level,
                "chunk_elems": encoded.chunk_elems,
                "frames": frames,
                "bias": bias_entry,
            }
        )
    header = json.dumps({"format": FORMAT_VERSION, "layers": layers}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), zlib.crc32(header)))
            f.write(header)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fail(path, layer: str | None, message: str) -> CompressedFileError:
    where = f"layer {layer!r} in " if layer else ""
    return CompressedFileError(f"{where}{path}: {message}")


def read_file(path: str | os.PathLike) -> list[Entry]:
    """Read and fully verify a .zlin file; returns [(name, encoded, bias or None)]."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise _fail(path, None, f"truncated: {size} bytes is shorter than the prefix")
        magic, version, header_len, header_crc = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise _fail(path, None, f"not a zstd-linear file (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise _fail(path, None, f"format version {version}, this reader reads {FORMAT_VERSION}")
        if header_len > size - _PREFIX.size:
            raise _fail(path, None, f"truncated: header of {header_len} bytes does not fit")
        header = f.read(header_len)
        if zlib.crc32(header) != header_crc:
            raise _fail(path, None, "header checksum mismatch (corrupted)")
        data_size = size - _PREFIX.size - header_len
        try:
            layers = json.loads(header)["layers"]
        except (ValueError, KeyError) as exc:
            raise _fail(path, None, f"malformed header: {exc}") from None
        for layer in layers:
            _check_sizes(path, layer, data_size)
        data = f.read(data_size)
    entries = []
    for layer in layers:
        try:
            entries.append(_entry(path, layer, data))
        except CompressedFileError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise _fail(path, layer.get("name"), f"malformed layer entry: {exc!r}") from None
    return entries


def _check_sizes(path, layer: dict, data_size: int) -> None:
    name = layer.get("name")
    try:
        if layer["dtype"] not in SUPPORTED_DTYPES or layer["layout"] not in LAYOUTS:
            raise _fail(
                path, name, f"unknown dtype {layer['dtype']!r} or layout {layer['layout']!r}"
            )
        spans = [(o, n) for o, n, _, _ in layer["frames"]]
        if layer["bias"] is not None:
            spans.append((layer["bias"]["offset"], layer["bias"]["length"]))
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CompressedFileError):
            raise
        raise _fail(path, name, f"malformed layer entry: {exc}") from None
    for offset, length in spans:
        if offset < 0 or length < 0 or offset + length > data_size:
            raise _fail(
                path,
                name,
                f"truncated: bytes {offset}..{offset + length} of the data "
                f"section, which holds {data_size}",
            )


def _entry(path, layer: dict, data: bytes) -> Entry:
    name = layer["name"]
    shape = tuple(int(d) for d in layer["shape"])
    if len(shape) != 2 or min(shape) < 0:
        raise _fail(path, name, f"weight shape {shape} is not (out_features, in_features)")
    frames = []
    for offset, length, raw, crc in layer["frames"]:
        blob = data[offset : offset + length]
        if zlib.crc32(blob) != crc:
            raise _fail(
                path, name, f"checksum mismatch in the frame at offset {offset} (corrupted)"
            )
        frames.append(Frame(blob, bool(raw)))
    encoded_layout = LAYOUTS[layer["layout"]]
    n_planes = encoded_layout.n_planes(layer["dtype"])
    encoded_itemsize = SUPPORTED_DTYPES[layer["dtype"]][1].itemsize
    chunk_elems = int(layer["chunk_elems"])
    numel = shape[0] * shape[1]
    n_chunks = max(1, -(-numel // chunk_elems)) if chunk_elems > 0 else -1
    if n_chunks < 1 or len(frames) != n_chunks * n_planes:
        raise _fail(path, name, f"{len(frames)} frames for {n_chunks} chunks x {n_planes} planes")
    for c in range(n_chunks):
        start = c * chunk_elems
        plane_bytes = min(chunk_elems, numel - start) * (1 if n_planes > 1 else encoded_itemsize)
        for frame in frames[c * n_planes : (c + 1) * n_planes]:
            if frame.raw and len(frame.data) != plane_bytes:
                raise _fail(
                    path,
                    name,
                    f"a raw frame of chunk {c} holds {len(frame.data)} bytes, not {plane_bytes}",
                )
    encoded = EncodedWeight(
        dtype=layer["dtype"],
        shape=shape,
        layout=layer["layout"],
        level=int(layer["level"]),
        chunk_elems=chunk_elems,
        frames=tuple(tuple(frames[c * n_planes : (c + 1) * n_planes]) for c in range(n_chunks)),
    )
    bias = None
    if layer["bias"] is not None:
        b = layer["bias"]
        blob = data[b["offset"] : b["offset"] + b["length"]]
        if zlib.crc32(blob) != b["crc32"]:
            raise _fail(path, name, "checksum mismatch in the bias (corrupted)")
        kind = SUPPORTED_DTYPES.get(b["dtype"])
        if kind is None or len(blob) != shape[0] * kind[1].itemsize:
            raise _fail(
                path, name, f"bias of {len(blob)} bytes / {b['dtype']} for {shape[0]} outputs"
            )
        bias = (
            torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy()).view(kind[0])
            if blob
            else torch.empty(0, dtype=kind[0])
        )
    return name, encoded, bias
