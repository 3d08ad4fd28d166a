"""Read and validate a safetensors header before any tensor is mapped or allocated.

The checks are the reference library's (``safetensors``' Rust loader) spelled out so each
refusal names the file, the tensor and what was expected: a header length that fits the
file, a JSON object of tensors with a known dtype, a shape of non-negative ints, and data
offsets that are in order, inside the file, non-overlapping, and exactly
``prod(shape) * itemsize`` bytes long.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from diffulex_edge.errors import DiffulexEdgeError

ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
MAX_HEADER_BYTES = 100 * 2**20  # the reference library's limit


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of the safetensors file ``path`` by name, every field validated."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DiffulexEdgeError(f"{path} is {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise DiffulexEdgeError(
                f"{path}: header length {n} does not fit the {size}-byte file "
                f"(or exceeds {MAX_HEADER_BYTES} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise DiffulexEdgeError(f"{path}: the safetensors header is not valid JSON: {err}") from err
    if not isinstance(header, dict):
        raise DiffulexEdgeError(f"{path}: the safetensors header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise DiffulexEdgeError(f"{path}: __metadata__ must map strings to strings")
    data_size = size - 8 - n
    entries = {name: _entry(path, name, info) for name, info in header.items()}
    # Tensors must tile the data section: sorted by offset, each starting where the last
    # ended, the last ending at the end of the file (no overlap, no hole, no trailing bytes).
    pos = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.begin != pos:
            raise DiffulexEdgeError(
                f"{path}: tensor {name!r} starts at data offset {e.begin}, expected {pos} "
                "(tensors overlap or leave a gap)"
            )
        pos = e.end
    if pos != data_size:
        raise DiffulexEdgeError(
            f"{path}: tensors cover {pos} bytes of data, the file holds {data_size}"
        )
    return entries


def _entry(path: Path, name: str, info) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise DiffulexEdgeError(f"{where} must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise DiffulexEdgeError(f"{where} has dtype {dtype!r}, expected one of {sorted(ITEMSIZE)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise DiffulexEdgeError(f"{where} has shape {shape!r}, expected a list of ints >= 0")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_int(o) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise DiffulexEdgeError(
            f"{where} has data_offsets {offsets!r}, expected [begin, end] with 0 <= begin <= end"
        )
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise DiffulexEdgeError(
            f"{where}: shape {shape} x {ITEMSIZE[dtype]} bytes ({dtype}) is {nbytes} bytes, "
            f"its data_offsets span {offsets[1] - offsets[0]}"
        )
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])
