"""A safetensors reader that maps shards into memory and reads tensors by byte range.

The format: an 8-byte little-endian header length N, N bytes of JSON mapping tensor names
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after
the header), then the data. We parse it ourselves so that one expert's rows of a stacked
``(E, out, in)`` tensor can be read alone: they are the contiguous byte range
``begin + e * row_bytes .. begin + (e + 1) * row_bytes``.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import re
import struct
import zlib
from dataclasses import dataclass
from math import prod
from pathlib import Path

import mlx.core as mx
import numpy as np

from moe_expert_cache.checked_json import is_int, loads_strict
from moe_expert_cache.errors import ExpertCacheError, MissingShardError

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
FLOAT_DTYPES = ("F32", "F16", "BF16")
_MAX_HEADER = 100 * 1024 * 1024
_SHARD_NAME = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``shard`` file, dtype name, shape, absolute byte range."""

    shard: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int
    name: str = ""

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along axis 0 (one expert of a stacked expert tensor)."""
        return self.nbytes // self.shape[0]


class SafetensorsShard:
    """One ``.safetensors`` file: its validated header and a read-only memory map.

    Validated before anything is mapped, as the reference ``safetensors`` library does:
    the header length fits the file, the header is strict JSON, every dtype is known,
    every shape times the item size equals its byte range, and the byte ranges tile the
    data section exactly (no overlap, no gap, no negative offset, no trailing bytes).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"safetensors shard not found: {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ExpertCacheError(f"{self.path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n < 2 or n > _MAX_HEADER or 8 + n > size:
                raise ExpertCacheError(
                    f"{self.path}: header length {n} does not fit a file of {size} bytes "
                    f"(expected 2 .. {min(_MAX_HEADER, size - 8)}; truncated or not safetensors)"
                )
            raw_header = f.read(n)
        self.header_sha256 = hashlib.sha256(raw + raw_header).hexdigest()
        header = loads_strict(raw_header, f"{self.path}: safetensors header")
        if not isinstance(header, dict):
            raise ExpertCacheError(f"{self.path}: safetensors header is not a JSON object")
        data_start = 8 + n
        # mlx writes ``"__metadata__": null`` when there is none.
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict) or not all(
            isinstance(v, str) for v in self.metadata.values()
        ):
            raise ExpertCacheError(f"{self.path}: __metadata__ must map strings to strings")
        self.tensors: dict[str, TensorInfo] = {}
        ranges = []
        for name, spec in header.items():
            dtype, shape, (begin, end) = _check_spec(self.path, name, spec)
            ranges.append((begin, end, name))
            self.tensors[name] = TensorInfo(
                self.path, dtype, shape, data_start + begin, data_start + end, name
            )
        expected = 0
        for begin, end, name in sorted(ranges):
            if begin != expected:
                how = "overlaps the tensor before it" if begin < expected else "leaves a gap"
                raise ExpertCacheError(
                    f"{self.path}: tensor {name!r} starts at data offset {begin}, expected "
                    f"{expected}: it {how}"
                )
            expected = end
        if expected != size - data_start:
            how = "truncated" if expected > size - data_start else "trailing bytes after"
            raise ExpertCacheError(
                f"{self.path}: {how} the data: the header's tensors span {expected} bytes, "
                f"the file holds {size - data_start} after the header"
            )
        self._file = open(self.path, "rb")  # noqa: SIM115 - kept open for the map's lifetime
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, info: TensorInfo, row: int | None = None, crc32: int | None = None) -> mx.array:
        """The whole tensor, or only index ``row`` along axis 0 (shape ``info.shape[1:]``).

        Copies exactly ``info.nbytes`` (or ``info.row_bytes``) bytes out of the map. With
        ``crc32`` (from an integrity record), the bytes must have that CRC-32.
        """
        np_dtype, mx_dtype = _DTYPES[info.dtype]
        if row is None:
            begin, shape = info.begin, info.shape
        else:
            if not info.shape or not 0 <= row < info.shape[0]:
                raise ExpertCacheError(
                    f"{self.path}: row {row} is outside tensor {info.name!r} of shape {info.shape}"
                )
            begin, shape = info.begin + row * info.row_bytes, info.shape[1:]
        count = prod(shape)
        view = np.frombuffer(self._map, dtype=np_dtype, count=count, offset=begin)
        if crc32 is not None and zlib.crc32(view) != crc32:
            del view  # a live view of the map would keep close() from unmapping it
            where = f"tensor {info.name!r}" + ("" if row is None else f" row {row}")
            raise ExpertCacheError(
                f"{self.path}: {where} fails its CRC-32 from the integrity record "
                "(the weights were changed or damaged)"
            )
        out = mx.array(view.reshape(shape))
        return out.view(mx_dtype) if info.dtype == "BF16" else out

    def array_view(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor as a read-only numpy view of the map (no copy; BF16 as uint16)."""
        np_dtype, _ = _DTYPES[info.dtype]
        view = np.frombuffer(self._map, dtype=np_dtype, count=prod(info.shape), offset=info.begin)
        return view.reshape(info.shape)

    def close(self) -> None:
        # A live view (a mapped embedding) keeps the map open: it is unmapped when the
        # last view is garbage-collected.
        with contextlib.suppress(BufferError):
            self._map.close()
        self._file.close()


def _check_spec(path: Path, name: str, spec) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """dtype, shape and relative ``(begin, end)`` of one header entry, checked."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise ExpertCacheError(f"{where}: expected an object with dtype, shape, data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ExpertCacheError(f"{where}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise ExpertCacheError(f"{where}: shape {shape!r} is not a list of integers >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ExpertCacheError(
            f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end"
        )
    nbytes = prod(shape) * _DTYPES[dtype][0].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise ExpertCacheError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
            f"expected shape {shape} x {dtype} = {nbytes}"
        )
    return dtype, tuple(shape), (offsets[0], offsets[1])


def read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a model's index, checked."""
    doc = loads_strict(index.read_bytes(), str(index))
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExpertCacheError(f"{index}: expected an object with a non-empty weight_map")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not _SHARD_NAME.fullmatch(shard):
            raise ExpertCacheError(
                f"{index}: weight_map[{tensor!r}] = {shard!r}, expected a file name "
                "ending in .safetensors in the model directory"
            )
    return weight_map


def open_shards(model_dir: str | Path) -> dict[str, SafetensorsShard]:
    """Open every weight shard of ``model_dir``, keyed by file name.

    When ``model.safetensors.index.json`` exists, every shard it names must exist and its
    ``weight_map`` must list exactly the tensors each shard holds; otherwise all
    ``model*.safetensors`` files are used. No tensor name may appear in two shards.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    index = model_dir / "model.safetensors.index.json"
    weight_map = read_index(index) if index.is_file() else None
    if weight_map is not None:
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (model_dir / name).is_file():
                raise MissingShardError(
                    f"shard {name} listed in {index.name} is missing from {model_dir}"
                )
    else:
        names = sorted(p.name for p in model_dir.glob("model*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no model*.safetensors shards in {model_dir}")
    shards: dict[str, SafetensorsShard] = {}
    try:
        seen: dict[str, str] = {}
        for name in names:
            shards[name] = shard = SafetensorsShard(model_dir / name)
            for tensor in shard.tensors:
                if tensor in seen:
                    raise ExpertCacheError(
                        f"{model_dir}: tensor {tensor!r} is in both {seen[tensor]} and {name}"
                    )
                seen[tensor] = name
        if weight_map is not None and weight_map != seen:
            wrong = sorted(set(weight_map.items()) ^ set(seen.items()))[:3]
            raise ExpertCacheError(
                f"{index}: weight_map does not match the shards' headers; expected "
                f"(tensor, shard) pairs from the headers, differing: {wrong}"
            )
    except BaseException:
        for shard in shards.values():
            shard.close()
        raise
    return shards
