"""A safetensors reader that maps shards into memory and reads tensors by byte range.

The format: an 8-byte little-endian header length N, N bytes of JSON mapping tensor names
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after
the header), then the data. We parse it ourselves so that one expert's rows of a stacked
``(E, out, in)`` tensor can be read alone: they are the contiguous byte range
``begin + e * row_bytes .. begin + (e + 1) * row_bytes``.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import mlx.core as mx
import numpy as np

# safetensors dtype -> (numpy dtype of the same width used to read the bytes, mlx dtype)
_DTYPES: dict[str, tuple[np.dtype, mx.Dtype]] = {
    "F32": (np.dtype("<f4"), mx.float32),
    "F16": (np.dtype("<f2"), mx.float16),
    # numpy has no bfloat16: read as uint16, then reinterpret the bits in MLX.
    "BF16": (np.dtype("<u2"), mx.bfloat16),
    "I64": (np.dtype("<i8"), mx.int64),
    "I32": (np.dtype("<i4"), mx.int32),
    "I16": (np.dtype("<i2"), mx.int16),
    "I8": (np.dtype("i1"), mx.int8),
    "U64": (np.dtype("<u8"), mx.uint64),
    "U32": (np.dtype("<u4"), mx.uint32),
    "U16": (np.dtype("<u2"), mx.uint16),
    "U8": (np.dtype("u1"), mx.uint8),
    "BOOL": (np.dtype("?"), mx.bool_),
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``shard`` file, dtype name, shape, absolute byte range."""

    shard: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along axis 0 (one expert of a stacked expert tensor)."""
        return self.nbytes // self.shape[0]


class SafetensorsShard:
    """One ``.safetensors`` file: its validated header and a read-only memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"safetensors shard not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(
                    f"{self.path}: header length {n} does not fit a file of {size} bytes "
                    "(truncated or not safetensors)"
                )
            header = json.loads(f.read(n))
        data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        need = data_start
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = spec["dtype"], tuple(int(s) for s in spec["shape"])
            if dtype not in _DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            begin, end = (data_start + int(o) for o in spec["data_offsets"])
            if end - begin != prod(shape) * _DTYPES[dtype][0].itemsize:
                raise ValueError(
                    f"{self.path}: tensor {name!r} spans {end - begin} bytes, "
                    f"expected {prod(shape)} x {dtype}"
                )
            self.tensors[name] = TensorInfo(self.path, dtype, shape, begin, end)
            need = max(need, end)
        if size < need:
            raise ValueError(
                f"{self.path}: truncated shard: header needs {need} bytes, file has {size}"
            )
        self._file = open(self.path, "rb")  # noqa: SIM115 - kept open for the map's lifetime
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, info: TensorInfo, row: int | None = None) -> mx.array:
        """The whole tensor, or only index ``row`` along axis 0 (shape ``info.shape[1:]``).

        Copies exactly ``info.nbytes`` (or ``info.row_bytes``) bytes out of the map.
        """
        np_dtype, mx_dtype = _DTYPES[info.dtype]
        if row is None:
            begin, shape = info.begin, info.shape
        else:
            begin, shape = info.begin + row * info.row_bytes, info.shape[1:]
        count = prod(shape)
        view = np.frombuffer(self._map, dtype=np_dtype, count=count, offset=begin)
        out = mx.array(view.reshape(shape))
        return out.view(mx_dtype) if info.dtype == "BF16" else out

    def close(self) -> None:
        self._map.close()
        self._file.close()


def open_shards(model_dir: str | Path) -> dict[str, SafetensorsShard]:
    """Open every weight shard of ``model_dir``, keyed by file name.

    When ``model.safetensors.index.json`` exists, every shard it names must exist;
    otherwise all ``model*.safetensors`` files are used.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for name in names:
            if not (model_dir / name).is_file():
                raise FileNotFoundError(
                    f"shard {name} listed in {index.name} is missing from {model_dir}"
                )
    else:
        names = sorted(p.name for p in model_dir.glob("model*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no model*.safetensors shards in {model_dir}")
    return {name: SafetensorsShard(model_dir / name) for name in names}
