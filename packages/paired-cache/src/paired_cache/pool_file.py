"""The neuron pool on storage: one file holding every MLP's pool, mapped read-only at run time.

Layout (format 1), little-endian:

    [0, 8)            magic b"PCPOOL\\x00\\x01"
    page-aligned      each layer's pool: N rows of row_bytes, one per neuron, the gate row |
                      up row | down_T row, zero-padded to the C core's row stride (a multiple
                      of 64 bytes and of the element size): PairedCache's in-memory layout
    ...               the header: UTF-8 JSON (format_version, dtype, layers: name, n_rows,
                      gate_cols, up_cols, hidden, row_bytes, offset, sha256 of the pool bytes)
    last 48 bytes     u64 header length | sha256 of the header (32 bytes) | the magic again

Format 3, a grid pool (write_pool_file's grid): as format 2, but each layer holds its
rows as the block-quantized codes they were dequantized from (paired_cache.grid_pool); the
header's codec is {"name": "grid", "block": 32} and each layer also records its up_kind
and down_kind.

Format 2, a compressed pool (write_pool_file's compress_level): the same magic, header
and trailer; each layer (page-aligned, nbytes long) holds no gate, and its rows are zstd
frames behind a table of their offsets (paired_cache.compressed_pool); the header also
records the codec ({"name": "zstd", "level": ...}) and each layer's nbytes in
place of row_bytes.

The header sits at the end so that the pools can be streamed out layer by layer. Opening
checks the trailer, the header's checksum, every field's type and range, and that every pool
lies inside the file, before mapping anything; the pools' own sha256 are checked only by
``verify()`` (it reads the whole file, which is what mapping on demand avoids).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from paired_cache._core import lib
from paired_cache._pages import MappedPages
from paired_cache.compressed_pool import (
    CODEC,
    CompressedLayer,
    FrameReader,
    RowScratch,
    check_level,
    encode_layer,
    read_offsets,
)
from paired_cache.errors import PairedCacheError
from paired_cache.grid_pool import BLOCK, KINDS, GridLayer, GridReader
from paired_cache.grid_pool import CODEC as GRID_CODEC
from paired_cache.grid_pool import encode_layer as encode_grid_layer

MAGIC = b"PCPOOL\x00\x01"
FORMAT_VERSION = 1
COMPRESSED_FORMAT_VERSION = 2
GRID_FORMAT_VERSION = 3
PAGE = 4096
TRAILER = struct.Struct("<Q32s8s")
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
MAX_DIM = 2**31 - 1


@dataclass(frozen=True)
class PoolLayer:
    """One MLP's pool inside the file: n_rows rows of row_bytes at offset."""

    name: str
    n_rows: int
    gate_cols: int
    up_cols: int
    hidden: int
    row_bytes: int
    offset: int
    sha256: str

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.row_bytes


def row_stride(gate_cols: int, up_cols: int, hidden: int, elem_size: int) -> int:
    """Bytes per pool row, as the C core lays it out (pc_pool_row_stride)."""
    stride = lib.pc_pool_row_stride(gate_cols, up_cols, hidden, elem_size)
    if stride < 0:
        raise PairedCacheError(
            f"pool row of gate_cols={gate_cols}, up_cols={up_cols}, hidden={hidden}, "
            f"elem_size={elem_size} is out of the C core's range"
        )
    return stride


def _pool_rows(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, stride: int) -> bytes:
    """gate, up: (N, hidden_in), down: (hidden, N) -> N rows of stride bytes."""
    n = up.shape[0]
    size = up.element_size()
    rows = torch.zeros(n, stride // size, dtype=up.dtype)  # (N, stride elements)
    g, u = gate.shape[1], up.shape[1]
    rows[:, :g] = gate
    rows[:, g : g + u] = up
    rows[:, g + u : g + u + down.shape[0]] = down.t()  # (hidden, N) -> (N, hidden)
    return rows.view(torch.uint8).numpy().tobytes()


def umask_mode(base: int = 0o666) -> int:
    """base less the process's umask: the mode open() (0o666) or mkdir (0o777) would give."""
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def write_pool_file(
    path: str | os.PathLike,
    layers: Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    progress: Callable[[str], None] | None = None,
    compress_level: int | None = None,
    grid: bool = False,
) -> list[PoolLayer] | list[CompressedLayer] | list[GridLayer]:
    """Write each MLP's weights into a pool file.

    The file is written to a temporary name beside path and renamed: a failure leaves no
    file at path.

    Args:
        path: the pool file to write.
        layers: (name, gate (N, h), up (N, h), down (h_out, N)) of each MLP, every layer
            in one dtype among float32, float16, bfloat16, float64; a gate of shape
            (N, 0) stands for an MLP without one.
        progress: called with each layer's name once it is written, or None.
        compress_level: None writes format 1 (rows as the C core reads them); a zstd
            level in [1, 22] writes format 2, one compressed frame per row of up | down_T
            (every gate must then be (N, 0): a compressed pool holds none).
        grid: write format 3, each row as the grid codes its float32 weights were
            dequantized from (paired_cache.grid_pool; gates (N, 0) as for format 2); a
            layer not exactly on a grid is refused by name and nothing is left at path.

    Returns:
        The layers written: PoolLayer (format 1), CompressedLayer (format 2) or GridLayer
        (format 3) each.
    """
    if not isinstance(grid, bool):
        raise PairedCacheError(f"grid must be a bool, got {grid!r}")
    if grid and compress_level is not None:
        raise PairedCacheError("grid=True takes no compress_level: a grid pool is not zstd")
    if compress_level is not None:
        check_level(compress_level)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    written: list[PoolLayer] = []
    dtype = None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            for name, gate, up, down in layers:
                if dtype is None:
                    dtype = up.dtype
                _check_layer(name, gate, up, down, dtype)
                n, g, u, hidden = up.shape[0], gate.shape[1], up.shape[1], down.shape[0]
                if grid or compress_level is not None:
                    written.append(_write_gateless(f, name, gate, up, down, compress_level))
                    if progress is not None:
                        progress(name)
                    continue
                stride = row_stride(g, u, hidden, up.element_size())
                offset = -(-f.tell() // PAGE) * PAGE
                f.write(bytes(offset - f.tell()))
                data = _pool_rows(gate, up, down, stride)
                f.write(data)
                written.append(
                    PoolLayer(
                        name, n, g, u, hidden, stride, offset, hashlib.sha256(data).hexdigest()
                    )
                )
                if progress is not None:
                    progress(name)
            if not written:
                raise PairedCacheError("no MLP layers to write")
            meta = {
                "format_version": FORMAT_VERSION,
                "dtype": str(dtype).removeprefix("torch."),
                "layers": [vars(layer) for layer in written],
            }
            if compress_level is not None:
                meta["format_version"] = COMPRESSED_FORMAT_VERSION
                meta["codec"] = {"name": CODEC, "level": compress_level}
            if grid:
                meta["format_version"] = GRID_FORMAT_VERSION
                meta["codec"] = {"name": GRID_CODEC, "block": BLOCK}
            header = json.dumps(meta).encode()
            f.write(header)
            f.write(TRAILER.pack(len(header), hashlib.sha256(header).digest(), MAGIC))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())  # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return written


def _write_gateless(f, name, gate, up, down, level: int | None) -> CompressedLayer | GridLayer:
    """Write one compressed layer at the next page of f: zstd frames at ``level``, or grid
    records (level None)."""
    if gate.shape[1]:
        raise PairedCacheError(
            f"{name}: a compressed pool holds no gate (the mask source reads gate_proj from "
            f"the safetensors); pass a gate of shape (N, 0)"
        )
    kinds: list[str] = []
    if level is None:
        data, up_kind, down_kind = encode_grid_layer(name, up, down)
        kinds = [up_kind, down_kind]
    else:
        data = encode_layer(up, down, level)[0]
    offset = -(-f.tell() // PAGE) * PAGE
    f.write(bytes(offset - f.tell()))
    f.write(data)
    return (GridLayer if level is None else CompressedLayer)(
        name,
        up.shape[0],
        0,
        up.shape[1],
        down.shape[0],
        offset,
        len(data),
        hashlib.sha256(data).hexdigest(),
        *kinds,
    )


def _check_layer(name, gate, up, down, dtype) -> None:
    for part, t in (("gate", gate), ("up", up), ("down", down)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise PairedCacheError(f"{name}: {part} must be a 2-D tensor")
        if t.dtype != dtype or t.dtype not in DTYPES.values():
            raise PairedCacheError(
                f"{name}: {part} has dtype {t.dtype}; every layer needs one dtype among "
                f"{sorted(DTYPES)} (the first layer's is {dtype})"
            )
    n = up.shape[0]
    if gate.shape[0] != n or down.shape[1] != n:
        raise PairedCacheError(
            f"{name}: gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}"
            " do not agree on N (gate, up: (N, h); down: (h_out, N))"
        )


def _field(layer: dict, key: str, low: int, high: int) -> int:
    value = layer.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PairedCacheError(
            f"pool file layer field {key}={value!r}; expected an int in [{low}, {high}]"
        )
    return value


class PoolFile(MappedPages):
    """A pool file mapped read-only. layers: the PoolLayer of each MLP, in file order.

    The mapping is shared by every PairedCache built on it and lives as long as any of
    them (or any view of it) does; its pages are file-backed page cache, never anonymous
    memory, and the kernel may drop them under memory pressure and read them again.

    Args:
        path: a pool file written by write_pool_file (format 1 or 2).

    Raises:
        PairedCacheError: a file that is not a pool file, or a damaged one.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        header, header_start = self._map()
        if hasattr(mmap, "MADV_RANDOM"):
            # Updates copy scattered rows: a page fault reads its own page, not the
            # device's readahead window around it (8 MiB on the development machines'
            # disk), which under a memory limit evicts what is in use for rows nobody
            # asked for.
            self._mmap.madvise(mmap.MADV_RANDOM)
        meta = self._read_meta(header)
        self.layers: list[PoolLayer] | list[CompressedLayer] = []
        self._frames: list[FrameReader] = []
        self.scratch = RowScratch()  # what its layers decode rows into, shared
        for raw in meta["layers"]:
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
                raise PairedCacheError(f"{self.path}: layer entry {raw!r:.80} has no name")
            if not isinstance(raw.get("sha256"), str) or len(raw["sha256"]) != 64:
                raise PairedCacheError(f"{self.path}: layer {raw['name']} has no sha256")
            if self.grid:
                self._add_grid(raw, header_start)
            elif self.codec is not None:
                self._add_compressed(raw, header_start)
            else:
                self._add_layer(raw, header_start)
        self._by_name = {layer.name: i for i, layer in enumerate(self.layers)}

    def _map(self) -> tuple[bytes, int]:
        """Map the file (self._mmap) once its magic, trailer and header checksum are checked;
        returns the header's bytes and where it starts."""
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(MAGIC) + TRAILER.size:
                raise PairedCacheError(f"{self.path}: {size} bytes is too short for a pool file")
            if f.read(len(MAGIC)) != MAGIC:
                raise PairedCacheError(f"{self.path}: not a paired-cache pool file (bad magic)")
            f.seek(size - TRAILER.size)
            header_len, digest, magic = TRAILER.unpack(f.read(TRAILER.size))
            if magic != MAGIC or header_len > size - len(MAGIC) - TRAILER.size:
                raise PairedCacheError(f"{self.path}: damaged trailer (header length {header_len})")
            header_start = size - TRAILER.size - header_len
            f.seek(header_start)
            header = f.read(header_len)
            if hashlib.sha256(header).digest() != digest:
                raise PairedCacheError(f"{self.path}: header checksum mismatch")
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return header, header_start

    def _read_meta(self, header: bytes) -> dict:
        """The header's JSON, once its format version, codec (self.codec), dtype
        (self.dtype) and layer list are checked."""
        try:
            meta = json.loads(header)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PairedCacheError(f"{self.path}: header is not JSON ({exc})") from None
        versions = (FORMAT_VERSION, COMPRESSED_FORMAT_VERSION, GRID_FORMAT_VERSION)
        if not isinstance(meta, dict) or meta.get("format_version") not in versions:
            raise PairedCacheError(
                f"{self.path}: format_version {meta.get('format_version') if isinstance(meta, dict) else meta!r}"
                f", expected one of {versions}"
            )
        # codec: None for format 1, {"name": CODEC, "level": int} for format 2,
        # {"name": "grid", "block": 32} for format 3.
        self.codec = None
        self.grid = meta["format_version"] == GRID_FORMAT_VERSION
        if self.grid:
            codec = meta.get("codec")
            if codec != {"name": GRID_CODEC, "block": BLOCK}:
                raise PairedCacheError(
                    f"{self.path}: format_version {GRID_FORMAT_VERSION} with codec "
                    f"{codec!r:.80}; expected {{'name': {GRID_CODEC!r}, 'block': {BLOCK}}}"
                )
            self.codec = codec
        if meta["format_version"] == COMPRESSED_FORMAT_VERSION:
            codec = meta.get("codec")
            if not isinstance(codec, dict) or codec.get("name") != CODEC:
                raise PairedCacheError(
                    f"{self.path}: format_version {COMPRESSED_FORMAT_VERSION} with codec "
                    f"{codec!r:.80}; expected {{'name': {CODEC!r}, 'level': 1..22}}"
                )
            check_level(codec.get("level"))
            self.codec = codec
        if meta.get("dtype") not in DTYPES:
            raise PairedCacheError(
                f"{self.path}: dtype {meta.get('dtype')!r}; expected one of {sorted(DTYPES)}"
            )
        self.dtype = DTYPES[meta["dtype"]]
        raw_layers = meta.get("layers")
        if not isinstance(raw_layers, list) or not raw_layers:
            raise PairedCacheError(f"{self.path}: header has no layers")
        return meta

    def _add_layer(self, raw: dict, header_start: int) -> None:
        """Check and add one format-1 layer."""
        n = _field(raw, "n_rows", 1, MAX_DIM)
        g = _field(raw, "gate_cols", 0, MAX_DIM)
        u = _field(raw, "up_cols", 1, MAX_DIM)
        h = _field(raw, "hidden", 1, MAX_DIM)
        stride = row_stride(g, u, h, self.dtype.itemsize)
        if raw.get("row_bytes") != stride:
            raise PairedCacheError(
                f"{self.path}: layer {raw['name']} row_bytes={raw.get('row_bytes')!r}, "
                f"the C core's stride is {stride}"
            )
        offset = _field(raw, "offset", len(MAGIC), header_start)
        if offset % PAGE or offset + n * stride > header_start:
            raise PairedCacheError(
                f"{self.path}: layer {raw['name']} at offset {offset} ({n} x {stride} bytes)"
                f" is not page-aligned or runs past the pools' end ({header_start})"
            )
        self.layers.append(PoolLayer(raw["name"], n, g, u, h, stride, offset, raw["sha256"]))

    def _add_compressed(self, raw: dict, header_start: int) -> None:
        """Check and add one format-2 layer, its frame offsets read and checked."""
        n = _field(raw, "n_rows", 1, MAX_DIM)
        _field(raw, "gate_cols", 0, 0)
        u = _field(raw, "up_cols", 1, MAX_DIM)
        h = _field(raw, "hidden", 1, MAX_DIM)
        offset = _field(raw, "offset", len(MAGIC), header_start)
        nbytes = _field(raw, "nbytes", 0, header_start)
        if offset % PAGE or offset + nbytes > header_start:
            raise PairedCacheError(
                f"{self.path}: layer {raw['name']} at offset {offset} ({nbytes} bytes) is not "
                f"page-aligned or runs past the pools' end ({header_start})"
            )
        layer = CompressedLayer(raw["name"], n, 0, u, h, offset, nbytes, raw["sha256"])
        data = memoryview(self._mmap)[offset : offset + nbytes]
        try:
            offsets = read_offsets(data, layer)
        except PairedCacheError as exc:
            raise PairedCacheError(f"{self.path}: {exc}") from None
        frames = data[layer.table_bytes :]
        self._frames.append(
            FrameReader(frames, offsets, offset + layer.table_bytes, u, h, self.dtype)
        )
        self.layers.append(layer)

    def _add_grid(self, raw: dict, header_start: int) -> None:
        """Check and add one format-3 layer."""
        n = _field(raw, "n_rows", BLOCK, MAX_DIM)
        _field(raw, "gate_cols", 0, 0)
        u = _field(raw, "up_cols", BLOCK, MAX_DIM)
        h = _field(raw, "hidden", 1, MAX_DIM)
        offset = _field(raw, "offset", len(MAGIC), header_start)
        nbytes = _field(raw, "nbytes", 0, header_start)
        kinds = (raw.get("up_kind"), raw.get("down_kind"))
        if self.dtype != torch.float32 or any(k not in KINDS for k in kinds):
            raise PairedCacheError(
                f"{self.path}: layer {raw['name']} of a grid pool has dtype {self.dtype}, "
                f"kinds {kinds!r}; expected float32 and kinds among {sorted(KINDS)}"
            )
        layer = GridLayer(raw["name"], n, 0, u, h, offset, nbytes, raw["sha256"], *kinds)
        if n % BLOCK or u % BLOCK or nbytes != layer.expected_bytes:
            raise PairedCacheError(
                f"{self.path}: layer {raw['name']} of {n} rows, up_cols {u}, hidden {h} holds "
                f"{nbytes} bytes; a grid layer of its kinds holds {layer.expected_bytes}"
            )
        if offset % PAGE or offset + nbytes > header_start:
            raise PairedCacheError(
                f"{self.path}: layer {raw['name']} at offset {offset} ({nbytes} bytes) is not "
                f"page-aligned or runs past the pools' end ({header_start})"
            )
        data = memoryview(self._mmap)[offset : offset + nbytes]
        self._frames.append(GridReader(data, offset, n, u, h, *kinds))
        self.layers.append(layer)

    @property
    def compressed(self) -> bool:
        """True for a format-2 or format-3 pool: zstd frames or grid records, read by
        frame_reader, no gate."""
        return self.codec is not None

    def frame_reader(self, layer: int | str) -> FrameReader | GridReader:
        """The reader of a compressed pool's layer: a FrameReader (format 2) or a
        GridReader (format 3); PairedCacheError for format 1."""
        if not self.compressed:
            raise PairedCacheError(f"{self.path} is not a compressed pool (format 1)")
        return self._frames[self.resolve(layer)]

    def index(self, name: str) -> int:
        if name not in self._by_name:
            raise PairedCacheError(f"{self.path} has no layer {name!r}; it has {len(self.layers)}")
        return self._by_name[name]

    def resolve(self, layer: int | str) -> int:
        """The index of layer, given by name or as an int in [0, len(layers))."""
        if isinstance(layer, str):
            return self.index(layer)
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < len(self.layers)
        ):
            raise PairedCacheError(
                f"layer must be a name or an int in [0, {len(self.layers)}), got {layer!r}"
            )
        return layer

    def layer_buffer(self, i: int) -> memoryview:
        """The read-only bytes of layer i's pool, a slice of the mapping (no copy)."""
        layer = self.layers[i]
        return memoryview(self._mmap)[layer.offset : layer.offset + layer.nbytes]

    def layer_range(self, i: int | str) -> tuple[int, int]:
        """(begin, end): the file's bytes that hold layer i's pool."""
        layer = self.layers[self.resolve(i)]
        return layer.offset, layer.offset + layer.nbytes

    def will_need(self, i: int | str) -> None:
        """Ask the kernel to read layer i's whole pool now (``MADV_WILLNEED``: one
        asynchronous request over its range; the mapping is otherwise ``MADV_RANDOM``, so a
        pass over every row would fault its pages in one at a time)."""
        self.will_need_range(*self.layer_range(i))

    def row_runs(self, i: int | str, rows) -> list[tuple[int, int]]:
        """(begin, end) byte ranges of the file covering layer i's ``rows`` (ascending row
        indices; in a compressed pool, their frames), consecutive rows as one range and ranges less than a page apart merged
        (they would read the pages between them anyway)."""
        import numpy as np

        i = self.resolve(i)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return []
        if self.compressed:  # each row's frame
            begins, ends = self._frames[i].byte_runs(rows)
        else:
            layer = self.layers[i]
            begins = layer.offset + rows * layer.row_bytes
            ends = begins + layer.row_bytes
        # A new range wherever the gap to the previous row's end is a page or more.
        breaks = np.flatnonzero(begins[1:] - ends[:-1] >= PAGE) + 1
        starts = np.concatenate(([0], breaks))
        stops = np.concatenate((breaks - 1, [rows.size - 1]))
        return list(zip(begins[starts].tolist(), ends[stops].tolist(), strict=True))

    def will_need_rows(self, i: int | str, rows) -> None:
        """Ask the kernel for the pages of layer i's ``rows`` only (``MADV_WILLNEED`` per
        range of row_runs): a token's picked rows, where reading the whole layer would
        read the rows it did not pick too."""
        for begin, end in self.row_runs(i, rows):
            self.will_need_range(begin, end)

    def verify(self) -> None:
        """Hash every pool (reads the whole file); PairedCacheError naming a damaged one."""
        for i, layer in enumerate(self.layers):
            if hashlib.sha256(self.layer_buffer(i)).hexdigest() != layer.sha256:
                raise PairedCacheError(f"{self.path}: layer {layer.name} pool checksum mismatch")

    @property
    def pool_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def mapping_rss(path: str | os.PathLike) -> dict[str, int]:
    """Resident bytes of this process's mappings of path, from /proc/self/smaps (Linux).

    Args:
        path: a mapped file (a pool file, a safetensors file).

    Returns:
        {"rss": ..., "anonymous": ...}; a read-only file mapping has anonymous == 0.
    """
    target = str(Path(path).resolve())
    totals = {"rss": 0, "anonymous": 0}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5] == target
            elif inside and fields[0] in ("Rss:", "Anonymous:"):
                totals[fields[0][:-1].lower()] += int(fields[1]) * 1024
    return totals


def process_rss() -> dict[str, int]:
    """This process's resident anonymous and file-backed bytes (/proc/self/status, Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


__all__ = [
    "COMPRESSED_FORMAT_VERSION",
    "FORMAT_VERSION",
    "GRID_FORMAT_VERSION",
    "PoolFile",
    "PoolLayer",
    "mapping_rss",
    "process_rss",
    "row_stride",
    "write_pool_file",
]
