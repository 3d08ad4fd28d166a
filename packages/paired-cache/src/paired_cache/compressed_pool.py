"""Compressed pools (pool file format 2): each neuron's up row | down_T row as one
independent zstd frame, so that a token decompresses only the frames of the rows it picked.

A compressed layer holds no gate: the mask source computes act(gate x) from gate_proj
mapped from the model's safetensors (SparseMLP's gate_proj child). Its bytes in the file:

    page-aligned      N + 1 u64 frame offsets, relative to the first frame: frame j is
                      bytes [off[j], off[j+1]) of the frames that follow
    then              N zstd frames, each one neuron's (up_cols + hidden) elements as
                      they lie in memory, with a content size and checksum

Why plain frames and level 3: on SmolLM2-135M's rows (float32 from a Q4_1 GGUF, 4,608
bytes each) level 3 and level 19 both reach ratio 1.72; the bytes shuffled into planes
first reached 1.78 at level 19, but un-shuffling 768 rows took ~9-20 ms per layer on this
2-core machine, more than decompressing them (~12 ms), and a token reads 30 layers.

The header's codec names the level; the layer's sha256 covers the offsets
and the frames, so PoolFile.verify() finds a damaged frame, and a frame damaged since
still fails its own checksum when decompressed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from paired_cache.errors import PairedCacheError

CODEC = "zstd"
DEFAULT_LEVEL = 3
LEVELS = (1, 22)
OFFSET = np.dtype("<u8")


def check_level(level) -> int:
    """level: a zstd compression level in LEVELS; PairedCacheError otherwise."""
    if isinstance(level, bool) or not isinstance(level, int) or not LEVELS[0] <= level <= LEVELS[1]:
        raise PairedCacheError(
            f"compress_level must be an int in [{LEVELS[0]}, {LEVELS[1]}] (zstd), got {level!r}"
        )
    return level


@dataclass(frozen=True)
class GatelessLayer:
    """What every compressed layer of a pool file records (formats 2 and 3): nbytes in
    all from offset, sha256 over them; gate_cols is always 0 (no gate block)."""

    name: str
    n_rows: int
    gate_cols: int
    up_cols: int
    hidden: int
    offset: int
    nbytes: int
    sha256: str


@dataclass(frozen=True)
class CompressedLayer(GatelessLayer):
    """One MLP's compressed pool inside the file: the frame offsets then the frames."""

    @property
    def table_bytes(self) -> int:
        return (self.n_rows + 1) * OFFSET.itemsize


def encode_layer(up: torch.Tensor, down: torch.Tensor, level: int) -> tuple[bytes, np.ndarray]:
    """up: (N, up_cols), down: (hidden, N) -> the layer's bytes (offsets then frames) and
    its frame offsets (N + 1,) u64, relative to the first frame."""
    rows = torch.cat([up, down.t()], dim=1)  # (N, up_cols + hidden)
    n = rows.shape[0]
    planes = rows.contiguous().view(torch.uint8).view(n, -1).numpy()  # (N, frame_bytes)
    width = planes.shape[1]
    segments = np.empty((n, 2), dtype=OFFSET)  # (offset, length) of each row
    segments[:, 0] = np.arange(n, dtype=OFFSET) * width
    segments[:, 1] = width
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    # Each frame is independent, so the threads change the time, never the bytes.
    frames = compressor.multi_compress_to_buffer(
        zstandard.BufferWithSegments(planes.tobytes(), segments.tobytes()), threads=-1
    )
    parts = [frames[i].tobytes() for i in range(n)]
    offsets = np.zeros(n + 1, dtype=OFFSET)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    return offsets.tobytes() + b"".join(parts), offsets


def read_offsets(data: memoryview, layer: CompressedLayer) -> np.ndarray:
    """The layer's frame offsets (N + 1,) int64, checked: from 0, non-decreasing, ending
    at the frames' size; PairedCacheError naming the layer otherwise."""
    if layer.nbytes < layer.table_bytes:
        raise PairedCacheError(
            f"layer {layer.name}: {layer.nbytes} bytes cannot hold {layer.n_rows + 1} offsets"
        )
    offsets = np.frombuffer(data[: layer.table_bytes], dtype=OFFSET).astype(np.int64)
    frames = layer.nbytes - layer.table_bytes
    if offsets[0] != 0 or offsets[-1] != frames or bool((np.diff(offsets) <= 0).any()):
        raise PairedCacheError(
            f"layer {layer.name}: damaged frame offsets (expected increasing from 0 to {frames})"
        )
    return offsets


class FrameReader:
    """Decompresses rows of one compressed layer, read where its frames lie in the mapping.

    frames: the layer's frames (a slice of the mapping, no copy); offsets: (N + 1,) int64
    relative to it; begin: the file offset of the first frame (for byte ranges)."""

    def __init__(
        self,
        frames: memoryview,
        offsets: np.ndarray,
        begin: int,
        up_cols: int,
        hidden: int,
        dtype: torch.dtype,
    ) -> None:
        self.frames, self.offsets, self.begin = frames, offsets, begin
        self.n_rows, self.up_cols, self.hidden, self.dtype = (
            offsets.shape[0] - 1,
            up_cols,
            hidden,
            dtype,
        )
        self.frame_size = (up_cols + hidden) * dtype.itemsize
        self._decompressor = zstandard.ZstdDecompressor()

    def compressed_bytes(self, idx: np.ndarray) -> int:
        """Bytes of the frames of rows idx ((m,) int64)."""
        return int((self.offsets[idx + 1] - self.offsets[idx]).sum())

    @property
    def total_bytes(self) -> int:
        """Bytes of every row's frame."""
        return int(self.offsets[-1])

    def byte_runs(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(begins, ends): the file's byte range of each row's frame, rows idx ascending."""
        return self.begin + self.offsets[idx], self.begin + self.offsets[idx + 1]

    def rows(self, idx: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows idx ((m,) int64 ascending; None: every row), decompressed in one call:
        (up (m, up_cols), down_T (m, hidden)), each contiguous, in the pool's dtype."""
        if idx is None:
            idx = np.arange(self.n_rows, dtype=np.int64)
        m = idx.shape[0]
        if m == 0:
            return (
                torch.empty(0, self.up_cols, dtype=self.dtype),
                torch.empty(0, self.hidden, dtype=self.dtype),
            )
        segments = np.empty((m, 2), dtype=OFFSET)  # (offset, length) of each frame
        segments[:, 0] = self.offsets[idx]
        segments[:, 1] = self.offsets[idx + 1] - self.offsets[idx]
        sizes = np.full(m, self.frame_size, dtype=OFFSET)
        try:
            out = self._decompressor.multi_decompress_to_buffer(
                zstandard.BufferWithSegments(self.frames, segments.tobytes()),
                decompressed_sizes=sizes.tobytes(),
            )
        except zstandard.ZstdError as exc:
            raise PairedCacheError(f"a compressed pool frame is damaged ({exc})") from None
        # A view of out's buffer, copied into up and down while out is referenced here
        # (clone, not contiguous(): a slice that is already contiguous would stay a view).
        rows = torch.from_numpy(_contiguous(out, m, self.frame_size)).view(self.dtype)
        rows = rows.view(m, self.up_cols + self.hidden)
        up = rows[:, : self.up_cols].clone(memory_format=torch.contiguous_format)
        down = rows[:, self.up_cols :].clone(memory_format=torch.contiguous_format)
        del out
        return up, down  # (m, up_cols), (m, hidden)


def _contiguous(out, m: int, frame_size: int) -> np.ndarray:
    """The (m, frame_size) uint8 rows of a BufferWithSegmentsCollection, without a copy
    where it can (a view that lives no longer than out).

    multi_decompress_to_buffer writes the frames one after another into one buffer when
    it runs on one thread; that buffer is not exposed, so it is viewed from its first
    segment's address when the last segment sits where that layout puts it, and the
    segments are joined otherwise."""
    first = np.frombuffer(out[0], dtype=np.uint8)
    last = np.frombuffer(out[m - 1], dtype=np.uint8)
    if last.ctypes.data == first.ctypes.data + (m - 1) * frame_size:
        whole = (ctypes.c_uint8 * (m * frame_size)).from_address(first.ctypes.data)
        return np.ctypeslib.as_array(whole).reshape(m, frame_size)
    joined = bytearray(b"".join(out[i].tobytes() for i in range(m)))
    return np.frombuffer(joined, dtype=np.uint8).reshape(m, frame_size)


__all__ = [
    "CODEC",
    "DEFAULT_LEVEL",
    "LEVELS",
    "CompressedLayer",
    "FrameReader",
    "GatelessLayer",
    "check_level",
    "encode_layer",
    "read_offsets",
]
