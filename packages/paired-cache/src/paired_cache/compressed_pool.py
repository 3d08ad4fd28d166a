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
import mmap
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from paired_cache.errors import PairedCacheError

CODEC = "zstd"
DEFAULT_LEVEL = 3
LEVELS = (1, 22)
OFFSET = np.dtype("<u8")
# Rows decoded at a time by a reader's rows(): a decode's temporaries stay a few of
# (DECODE_ROWS, up_cols + hidden) elements however many rows it decodes.
DECODE_ROWS = 64


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

    def rows(
        self,
        idx: np.ndarray | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows idx ((m,) int64 ascending; None: every row), decompressed: (up (m,
        up_cols), down_T (m, hidden)), each contiguous, in the pool's dtype.

        DECODE_ROWS frames are decompressed per call, so the temporaries of a decode stay
        small whatever m is. ``out``: two contiguous tensors of those shapes and the pool's
        dtype to decompress into (a reused scratch), returned; fresh tensors when None."""
        if idx is None:
            idx = np.arange(self.n_rows, dtype=np.int64)
        m = idx.shape[0]
        up, down = check_out(out, m, self.up_cols, self.hidden, self.dtype)
        for s in range(0, m, DECODE_ROWS):
            e = min(m, s + DECODE_ROWS)
            self._decompress_into(idx[s:e], up[s:e], down[s:e])
        return up, down

    def _decompress_into(self, idx: np.ndarray, up: torch.Tensor, down: torch.Tensor) -> None:
        """The frames of rows idx ((n,) int64), decompressed in one call and copied into up
        (n, up_cols) and down (n, hidden)."""
        n = idx.shape[0]
        segments = np.empty((n, 2), dtype=OFFSET)  # (offset, length) of each frame
        segments[:, 0] = self.offsets[idx]
        segments[:, 1] = self.offsets[idx + 1] - self.offsets[idx]
        sizes = np.full(n, self.frame_size, dtype=OFFSET)
        try:
            out = self._decompressor.multi_decompress_to_buffer(
                zstandard.BufferWithSegments(self.frames, segments.tobytes()),
                decompressed_sizes=sizes.tobytes(),
            )
        except zstandard.ZstdError as exc:
            raise PairedCacheError(f"a compressed pool frame is damaged ({exc})") from None
        # A view of out's buffer, copied into up and down while out is referenced here.
        rows = torch.from_numpy(_contiguous(out, n, self.frame_size)).view(self.dtype)
        rows = rows.view(n, self.up_cols + self.hidden)
        up.copy_(rows[:, : self.up_cols])
        down.copy_(rows[:, self.up_cols :])
        del rows, out


def check_out(
    out: tuple[torch.Tensor, torch.Tensor] | None,
    m: int,
    up_cols: int,
    hidden: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (up (m, up_cols), down_T (m, hidden)) tensors a reader's rows() decodes into:
    ``out``'s, checked, or fresh ones."""
    if out is None:
        return torch.empty(m, up_cols, dtype=dtype), torch.empty(m, hidden, dtype=dtype)
    up, down = out
    for t, shape in ((up, (m, up_cols)), (down, (m, hidden))):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise PairedCacheError(
                f"rows(out=...) needs contiguous {dtype} tensors of shapes {(m, up_cols)} and "
                f"{(m, hidden)}, got {t.dtype} {tuple(t.shape)}"
            )
    return up, down


class RowScratch:
    """The memory a pool's layers decode rows into, one buffer per thread, reused.

    Layers run one after another, so the layers of one pool file share it: a forward
    pass allocates its decoded rows once (the largest: a token's rows, or a block of a
    dense prefill's), where each decode allocating its own would leave the allocator's heap
    fragmented by tensors of a few MiB, and the process's anonymous memory growing.
    What ``take`` returns is valid until the next ``take`` on the same thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def take(
        self, m: int, up_cols: int, hidden: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(up (m, up_cols), down_T (m, hidden)), contiguous views of the scratch."""
        need = m * (up_cols + hidden)
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.dtype != dtype or buf.numel() < need:
            self._local.buf = None  # the old one freed before the new is made
            buf = self._local.buf = _anonymous(need, dtype)
        up = buf[: m * up_cols].view(m, up_cols)
        return up, buf[m * up_cols : need].view(m, hidden)

    def release(self) -> None:
        """Give this thread's buffer back to the system (the next ``take`` maps a new
        one); what ``take`` returned must no longer be used."""
        self._local.buf = None


def _anonymous(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """numel elements of dtype in a mapping of their own, unmapped when the tensor and its
    views are freed: memory the allocator's heap cannot keep once released."""
    nbytes = max(1, numel * dtype.itemsize)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Outside inference mode: a buffer first made under it could not be written in a
    # later call made under torch.no_grad() only.
    with torch.inference_mode(False), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the mapping is writable
        return torch.frombuffer(mapping, dtype=dtype, count=numel)


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
    "DECODE_ROWS",
    "DEFAULT_LEVEL",
    "LEVELS",
    "CompressedLayer",
    "FrameReader",
    "GatelessLayer",
    "RowScratch",
    "check_level",
    "check_out",
    "encode_layer",
    "read_offsets",
]
