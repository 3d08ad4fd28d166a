"""The ``.zlin`` file: compressed Linear layers keyed by fully qualified name.

Layout (all integers little-endian)::

    magic        8 bytes   b"ZSTDLIN\\0"
    version      u32       2, or 3 where a frame is bit-packed (see below)
    header_len   u64       bytes of the JSON header
    header_crc   u32       zlib.crc32 of the header bytes
    header       JSON      {"format": version, "layers": [layer, ...]}
    data                   frames and biases, back to back, nothing else

    layer = {"name": fully qualified module name, "dtype": "float32" | "bfloat16" |
             "float16", "shape": [out, in], "layout": LAYOUTS name, "level": int,
             "chunk_elems": int,
             "frames": [[offset, length, kind, crc32], ...],  # chunk-major, plane-minor
             "bias": null | {"dtype", "offset", "length", "crc32"},
             "weight_crc32": record_crc32 of the decoded weight}

Offsets are relative to the start of ``data``. The header is checked field by field
(fileheader.py) before any byte of ``data`` is read, every frame's CRC-32 (of its
stored bytes) before it is decoded, and every weight is decoded once and its bytes
checked against ``weight_crc32``: frame CRCs alone cover the compressed bytes, not
the weight a layout or dtype field makes of them. ``weight_crc32`` and the bias
``crc32`` also cover the layer's name, dtype and shape (see record_crc32). Anything
wrong raises a CompressedFileError naming the file and the layer or field.

A frame's kind is 0 (a zstd frame), 1 (the plane's raw bytes) or 2 (the plane
bit-packed: codec.bitpack). Kind 2 came with version 3 (zstd-linear 0.7); a file
without it is written as version 2, which zstd-linear 0.2-0.6 read too.

Version 1 files (zstd-linear 0.1) carry no checksum of the decoded weights and are
refused with a message saying to re-compress. Files are written to a temporary name
in the target directory and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch
import zstandard

from zstd_linear._core import check_bitpack
from zstd_linear.codec import FRAME_KINDS, EncodedWeight, Frame
from zstd_linear.decoder import DecodeError, Decoder
from zstd_linear.errors import CompressedFileError, ZstdLinearError
from zstd_linear.fileheader import LayerSpec, fail, parse_header, record_crc32
from zstd_linear.layout import SUPPORTED_DTYPES

MAGIC = b"ZSTDLIN\0"
#: The newest version this writes; files without bit-packed frames are written as 2.
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)
_READS = f"this reader reads versions {' and '.join(map(str, READ_VERSIONS))}"
_PREFIX = struct.Struct("<8sIQI")  # magic, version, header_len, header_crc

__all__ = ["FORMAT_VERSION", "MAGIC", "CompressedFileError", "read_file", "write_file"]


Entry = tuple[str, EncodedWeight, "torch.Tensor | None"]


def umask_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file under this process's
    umask (mkstemp's 0600 would hide the output from everyone else)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_file(path: str | os.PathLike, entries: list[Entry]) -> None:
    """Write a .zlin file atomically (to a temporary name, then renamed).

    Args:
        path: the file to write; replaced if it exists.
        entries: (name, EncodedWeight, bias (out_features,) or None) per layer.

    Raises:
        OSError: the file cannot be written; no file is left at ``path``'s temporary
            name.
    """
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
                frames.append([start, length, FRAME_KINDS.index(frame.kind), crc])
        bias_entry = None
        if bias is not None:
            b = bias.detach().to("cpu").contiguous()
            start, length, crc = put(
                b.view(-1).view(torch.uint8).numpy().tobytes() if b.numel() else b""
            )
            dtype = str(b.dtype).removeprefix("torch.")
            bias_entry = {
                "dtype": dtype,
                "offset": start,
                "length": length,
                "crc32": record_crc32(crc, name, "bias", dtype, tuple(b.shape)),
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
                "weight_crc32": record_crc32(
                    _weight_crc32(encoded), name, "weight", encoded.dtype, encoded.shape
                ),
            }
        )
    packed = any(f[2] == FRAME_KINDS.index("bitpack") for layer in layers for f in layer["frames"])
    version = FORMAT_VERSION if packed else 2
    header = json.dumps({"format": version, "layers": layers}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), umask_mode())
            f.write(_PREFIX.pack(MAGIC, version, len(header), zlib.crc32(header)))
            f.write(header)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _weight_crc32(encoded: EncodedWeight) -> int:
    if encoded.crc32 is not None:
        return encoded.crc32
    return zlib.crc32(Decoder(threads=1).decode(encoded).view(-1).view(torch.uint8).numpy())


def read_file(path: str | os.PathLike, *, threads: int | None = None) -> list[Entry]:
    """Read and fully verify a .zlin file.

    The file is memory-mapped read-only and every frame's ``data`` is a memoryview of
    the mapping: compressed bytes stay file-backed pages, which the kernel can drop
    under memory pressure and read again, never anonymous copies. Every weight is
    decoded once (with ``threads`` threads, into one reused buffer the size of the
    largest layer) and checked against its recorded checksum. Biases are copied
    (out_features values each).

    Args:
        path: a file written by ``write_file`` or ``save_compressed``.
        threads: decode threads (default min(2, cores)).

    Returns:
        list of (name, EncodedWeight, bias (out_features,) or None), in file order.

    Raises:
        CompressedFileError: the file is truncated, corrupted, of another version or
            malformed (a DecodeError when a weight does not decode).
        ZstdLinearError: a bad ``threads``.
        OSError: ``path`` cannot be read (FileNotFoundError: it does not exist).
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise fail(path, None, f"truncated: {size} bytes is shorter than the prefix")
        magic, version, header_len, header_crc = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise fail(path, None, f"not a zstd-linear file (magic {magic!r})")
        if version == 1:
            raise fail(
                path,
                None,
                "format version 1 (zstd-linear 0.1) has no checksum of the decoded weights; "
                f"{_READS}: re-compress the model "
                "(compress_model + save_compressed), or read the file with zstd-linear 0.1",
            )
        if version not in READ_VERSIONS:
            raise fail(path, None, f"format version {version}, {_READS}")
        if header_len > size - _PREFIX.size:
            raise fail(
                path,
                None,
                f"truncated: a header of {header_len} bytes does not fit in {size} bytes",
            )
        header = f.read(header_len)
        if zlib.crc32(header) != header_crc:
            raise fail(path, None, "header checksum mismatch (corrupted)")
        data_start = _PREFIX.size + header_len
        data_size = size - data_start
        layers = parse_header(path, header, version, data_size)
        data = _map_data(f, data_start, data_size)
    entries = [_entry(path, layer, data) for layer in layers]
    _verify_weights(path, entries, layers, threads)
    _read_at_random(data)
    return entries


def _read_at_random(data: memoryview) -> None:
    """Mark the file's mapping MADV_RANDOM once it has been read through (sequentially,
    to check it): a later page fault reads its own page, not the disk's read-ahead
    around it. The decoder asks for each weight's frames ahead of decoding them
    (``posix_madvise(WILLNEED)`` over their range), so the frames are still read in
    large requests; what random access stops is the read-ahead of pages no decode asked
    for, which under a tight limit evicted the pages being used (see
    ``decoder._ChunkTable.will_need``)."""
    mapping = data.obj
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)


def _map_data(f, start: int, size: int) -> memoryview:
    """The data section as a read-only memoryview of a private mapping of the file."""
    if size == 0:
        return memoryview(b"")
    # mmap offsets must be page-aligned: map from the page holding ``start``.
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(f.fileno(), start + size - aligned, access=mmap.ACCESS_READ, offset=aligned)
    # The memoryviews keep the mapping alive for as long as any frame refers to it.
    return memoryview(mapping)[start - aligned :]


def _entry(path, layer: LayerSpec, data: memoryview) -> Entry:
    name = layer.name
    frames = []
    for k, spec in enumerate(layer.frames):
        blob = data[spec.offset : spec.offset + spec.length]
        if zlib.crc32(blob) != spec.crc32:
            raise fail(
                path, name, f"checksum mismatch in the frame at offset {spec.offset} (corrupted)"
            )
        if spec.kind == "bitpack":
            try:
                check_bitpack(blob, spec.size)
            except ZstdLinearError as exc:
                raise fail(
                    path,
                    name,
                    f"frame {k} is not a bit-packed plane of {spec.size} bytes "
                    f"(mask {blob[0]:#04x}, value {blob[1]:#04x}, {spec.length} bytes): {exc}",
                ) from None
        elif spec.kind == "zstd":
            try:
                content = zstandard.frame_content_size(blob)
            except zstandard.ZstdError:
                content = None
            if content != spec.size:
                found = "no zstd frame" if content is None else f"a zstd frame of {content} bytes"
                raise fail(path, name, f"frame {k} must decode to {spec.size} bytes, found {found}")
        frames.append(Frame(blob, spec.kind))
    n_planes = layer.n_planes
    encoded = EncodedWeight(
        dtype=layer.dtype,
        shape=layer.shape,
        layout=layer.layout,
        level=layer.level,
        chunk_elems=layer.chunk_elems,
        frames=tuple(tuple(frames[c : c + n_planes]) for c in range(0, len(frames), n_planes)),
    )
    bias = None
    if layer.bias is not None:
        b = layer.bias
        blob = data[b.offset : b.offset + b.length]
        if record_crc32(zlib.crc32(blob), name, "bias", b.dtype, layer.shape[:1]) != b.crc32:
            raise fail(path, name, f"checksum mismatch in the {b.dtype} bias (corrupted)")
        torch_dtype = SUPPORTED_DTYPES[b.dtype][0]
        bias = (
            torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy()).view(torch_dtype)
            if blob
            else torch.empty(0, dtype=torch_dtype)
        )
    return name, encoded, bias


# A weight is verified this many bytes of chunks at a time (whole chunks, at least one),
# so that loading never holds its largest layer decoded (SmolLM2's embedding: 113 MiB).
VERIFY_GROUP_BYTES = 4 << 20


def _verify_weights(path, entries: list[Entry], layers: list[LayerSpec], threads) -> None:
    """Decode every weight once and compare its bytes with the recorded checksum; the
    verified CRC is kept on the EncodedWeight, so a later save writes the same record.
    A weight is decoded a group of chunks at a time into one reused buffer."""
    groups = [
        [(span, encoded.span_bytes(span)) for span in encoded.chunk_groups(VERIFY_GROUP_BYTES)]
        for _, encoded, _ in entries
    ]
    largest = max((nbytes for spans in groups for _, nbytes in spans), default=0)
    try:
        out = torch.empty(largest, dtype=torch.uint8)  # reused for every group
    except (RuntimeError, MemoryError):
        raise fail(path, None, f"cannot allocate {largest} bytes to decode into") from None
    decoder = Decoder(threads)
    try:
        for i, (layer, (name, encoded, bias)) in enumerate(zip(layers, entries, strict=True)):
            crc = 0
            for span, nbytes in groups[i]:
                buf = out[:nbytes]
                try:
                    decoder.decode_chunks_into(encoded, span, buf)
                except DecodeError as exc:
                    raise fail(path, name, str(exc)) from None
                crc = zlib.crc32(buf.numpy(), crc)
            if record_crc32(crc, name, "weight", layer.dtype, layer.shape) != layer.weight_crc32:
                raise fail(
                    path,
                    name,
                    "the decoded weight does not match its checksum (a frame, the layout, "
                    "dtype, shape or name differs from what was written)",
                )
            entries[i] = (name, dataclasses.replace(encoded, crc32=crc), bias)
    finally:
        decoder.close()
