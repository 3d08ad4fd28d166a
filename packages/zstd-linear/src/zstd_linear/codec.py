"""Encoding a weight: byte planes, independent zstd frames per 256 KiB chunk, raw fallback.

The weight's elements are cut into chunks of ``chunk_elems`` elements; every chunk
holds one frame per plane, so any chunk decodes on its own (in parallel) into its own
slice of the output. Each frame is stored in one of three kinds:

- ``"zstd"``: a zstd frame (exponent planes);
- ``"bitpack"``: the plane's bits that are the same in every byte of the chunk dropped,
  the rest packed (the low plane of bfloat16's "exponent-mantissa" layout holds the
  exponent's top bit, 0 in every weight of magnitude below 2: 7 bits a byte). The C core
  unpacks it at several GB/s, where zstd's Huffman decode of the same plane runs near 1;
- ``"raw"``: the plane's bytes (mantissa planes of trained weights), joined straight
  from the file.

zstd is kept only where it saves at least ``CodecConfig.raw_below`` of the plane over
the better of the other two, which decode at memory speed.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from zstd_linear.errors import ZstdLinearError
from zstd_linear.layout import LAYOUTS, SUPPORTED_DTYPES, dtype_name

DEFAULT_LEVEL = 3
#: 256 KiB: one weight's chunks share the decode threads (SmolLM2's 442 KiB k_proj is 2
#: chunks, where 1 MiB made it 1) at 0.02% of the ratio of 1 MiB chunks on SmolLM2 and
#: MiniLM bf16 (0.9.0; benchmarks/results/codec.json).
DEFAULT_CHUNK_BYTES = 256 << 10
DEFAULT_LAYOUT = "auto"
#: The layout "auto" picks per dtype (benchmarks/results/planes.json): on MiniLM bf16,
#: "exponent-mantissa" reaches 1.5042 (zipnn 1.4997, "exponent" 1.4989); on float32 it
#: gains 0.14% on MiniLM at half the frame decode speed, so float32 keeps "exponent";
#: float16 rotates by 1 in both.
AUTO_LAYOUTS = {"float32": "exponent", "bfloat16": "exponent-mantissa", "float16": "exponent"}
#: A frame is stored raw when zstd saves less than this fraction of its plane.
DEFAULT_RAW_BELOW = 0.05


@dataclass(frozen=True)
class CodecConfig:
    """How weights are encoded; checked when made.

    Args:
        level: zstd level, 1..22 (default 3).
        layout: "auto" (default: AUTO_LAYOUTS picks per dtype) or a LAYOUTS name
            ("exponent", "exponent-mantissa", or "zstd" = plain zstd).
        chunk_bytes: uncompressed bytes per independently decodable chunk (>= 4 KiB).
        raw_below: zstd is kept only where it saves at least this fraction of the plane
            over the frame's fast form (bit-packed where some bits are constant, else
            raw), which decodes at memory speed; in [0, 1); 0 keeps zstd whenever
            smaller.

    Raises:
        ZstdLinearError: a value out of its range, named with the range.
    """

    level: int = DEFAULT_LEVEL
    layout: str = DEFAULT_LAYOUT
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    raw_below: float = DEFAULT_RAW_BELOW

    def __post_init__(self):
        if isinstance(self.level, bool) or not isinstance(self.level, int):
            raise ZstdLinearError(f"level must be an int in 1..22, got {self.level!r}")
        if not 1 <= self.level <= 22:
            raise ZstdLinearError(f"level must be in 1..22, got {self.level}")
        if self.layout != "auto" and self.layout not in LAYOUTS:
            raise ZstdLinearError(
                f"layout must be 'auto' or one of {sorted(LAYOUTS)}, got {self.layout!r}"
            )
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4096:
            raise ZstdLinearError(f"chunk_bytes must be an int >= 4096, got {self.chunk_bytes!r}")
        if (
            isinstance(self.raw_below, bool)
            or not isinstance(self.raw_below, (int, float))
            or not 0 <= self.raw_below < 1
        ):
            raise ZstdLinearError(f"raw_below must be a number in [0, 1), got {self.raw_below!r}")

    def layout_for(self, dtype: str) -> str:
        """The layout a weight of ``dtype`` is encoded with.

        Args:
            dtype: a ``SUPPORTED_DTYPES`` name (``"bfloat16"``).

        Returns:
            A ``LAYOUTS`` name: ``layout`` itself, or the dtype's under ``"auto"``.
        """
        return AUTO_LAYOUTS[dtype] if self.layout == "auto" else self.layout

    def compression_params(self, layout: str) -> zstandard.ZstdCompressionParameters:
        """The zstd parameters for a plane of ``layout`` (a ``LAYOUTS`` name) at ``level``."""
        if not LAYOUTS[layout].planes:
            return zstandard.ZstdCompressionParameters.from_level(self.level)
        # A plane of exponents is close to i.i.d. symbols: the low levels' greedy
        # parsers take many short matches that cost more than the literals they
        # replace (3.40 bits/exponent on MiniLM bf16 at level 3). The optimal parser
        # (target length 16) codes it at 2.68 bits and decodes ~2x faster,
        # since fewer sequences remain; the level still sets window and search sizes.
        base = zstandard.ZstdCompressionParameters.from_level(self.level)
        if base.strategy >= zstandard.STRATEGY_BTOPT:
            return base
        return zstandard.ZstdCompressionParameters.from_level(
            self.level, strategy=zstandard.STRATEGY_BTOPT, target_length=16
        )


#: Frame kinds, by their number in the .zlin header.
FRAME_KINDS = ("zstd", "raw", "bitpack")


@dataclass(frozen=True)
class Frame:
    """One plane of one chunk: zstd-compressed bytes, the plane's raw bytes, or the
    plane bit-packed (``kind`` "zstd", "raw" or "bitpack"; see the module docstring).

    Args:
        data: ``bytes`` (anonymous memory) after encode_weight; a read-only memoryview
            of the file's mapping (file-backed pages) after read_file / load_compressed.
        kind: a FRAME_KINDS name; ``True`` / ``False`` (0.6's ``raw`` flag) mean "raw" /
            "zstd".

    Raises:
        ZstdLinearError: ``kind`` is not a FRAME_KINDS name.
    """

    data: bytes | memoryview
    kind: str

    def __post_init__(self):
        if isinstance(self.kind, bool):
            object.__setattr__(self, "kind", "raw" if self.kind else "zstd")
        if self.kind not in FRAME_KINDS:
            raise ZstdLinearError(f"kind must be one of {FRAME_KINDS}, got {self.kind!r}")

    @property
    def raw(self) -> bool:
        return self.kind == "raw"

    @property
    def file_backed(self) -> bool:
        return isinstance(self.data, memoryview)


@dataclass(frozen=True)
class EncodedWeight:
    """A losslessly encoded (out_features, in_features) weight.

    Made by ``encode_weight`` and ``read_file``.

    Args:
        dtype: a SUPPORTED_DTYPES name.
        shape: (out_features, in_features).
        layout: the LAYOUTS name its planes were split with.
        level: the zstd level it was encoded at.
        chunk_elems: elements per chunk; chunk c covers elements
            [c * chunk_elems, min((c + 1) * chunk_elems, numel)) in row-major order.
        frames: ``frames[c][p]`` is plane p of chunk c.
        crc32: zlib.crc32 of the weight's bytes (row-major, little-endian) as encoded,
            which a decode must reproduce; None where unknown (then save_compressed
            decodes once).
    """

    dtype: str
    shape: tuple[int, ...]
    layout: str
    level: int
    chunk_elems: int
    frames: tuple[tuple[Frame, ...], ...]
    crc32: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return SUPPORTED_DTYPES[self.dtype][1].itemsize

    @property
    def original_bytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def compressed_bytes(self) -> int:
        return sum(len(f.data) for chunk in self.frames for f in chunk)

    @property
    def file_backed_bytes(self) -> int:
        """Compressed bytes that are pages of a mapped file (the rest are anonymous)."""
        return sum(len(f.data) for chunk in self.frames for f in chunk if f.file_backed)

    @property
    def torch_dtype(self) -> torch.dtype:
        return SUPPORTED_DTYPES[self.dtype][0]

    def chunk_range(self, c: int) -> tuple[int, int]:
        """The elements [start, stop) of chunk ``c``, in the flattened weight.

        Args:
            c: a chunk index, 0..len(frames) - 1.

        Returns:
            (start, stop), element offsets.
        """
        start = c * self.chunk_elems
        return start, min(start + self.chunk_elems, self.numel)

    def expected_chunks(self) -> int:
        """How many chunks ``numel`` elements take at ``chunk_elems`` a chunk (at least 1)."""
        return max(1, -(-self.numel // self.chunk_elems))

    def chunk_groups(self, max_bytes: int) -> list[range]:
        """The chunks in consecutive groups, to decode a weight a group at a time.

        Args:
            max_bytes: the most decoded bytes a group holds (at least one chunk each).

        Returns:
            Consecutive ranges of chunk indices covering every chunk.
        """
        group = max(1, max_bytes // (self.chunk_elems * self.itemsize))
        n = len(self.frames)
        return [range(c, min(c + group, n)) for c in range(0, n, group)]

    def span_range(self, chunks: range) -> tuple[int, int]:
        """The elements of consecutive chunks.

        Args:
            chunks: a non-empty range of chunk indices, step 1.

        Returns:
            (start, stop), element offsets in the flattened weight.
        """
        return self.chunk_range(chunks.start)[0], self.chunk_range(chunks.stop - 1)[1]

    def span_bytes(self, chunks: range) -> int:
        """The decoded size of consecutive chunks.

        Args:
            chunks: a non-empty range of chunk indices, step 1.

        Returns:
            Their decoded bytes.
        """
        start, stop = self.span_range(chunks)
        return (stop - start) * self.itemsize


def view_weight(raw: torch.Tensor, encoded: EncodedWeight) -> torch.Tensor:
    """raw: (original_bytes,) uint8 -> the weight, encoded.shape, encoded's dtype (a view)."""
    if raw.numel() == 0:  # torch cannot reinterpret an empty tensor's dtype
        return torch.empty(encoded.shape, dtype=encoded.torch_dtype)
    return raw.view(encoded.torch_dtype).view(encoded.shape)


_local = threading.local()


def _compressor(config: CodecConfig, layout: str) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not thread-safe: one per thread and parameter set.
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    key = (config.level, LAYOUTS[layout].planes)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(compression_params=config.compression_params(layout))
    return cache[key]


def bitpack(plane: np.ndarray) -> bytes | None:
    """``plane`` ((n,) uint8) with its constant bits dropped: [mask, value] then one
    k-bit code per byte (its free bits, lowest first), LSB-first; 1 <= k <= 7, None
    when no bit is constant. ``_core.unpack_bits`` is the inverse."""
    if plane.size == 0:
        return None
    low, high = int(np.bitwise_and.reduce(plane)), int(np.bitwise_or.reduce(plane))
    # A constant plane keeps bit 7 (1 bit a byte): no frame may expand more than 8x, so
    # that a crafted header cannot declare terabytes from a few stored bytes.
    mask = ~(low ^ high) & 0x7F if low == high else ~(low ^ high) & 0xFF
    if mask == 0:
        return None
    free = [b for b in range(8) if not mask >> b & 1]
    bits = np.unpackbits(plane[:, None], axis=1, bitorder="little")[:, free]
    codes = np.packbits(bits.reshape(-1), bitorder="little")
    return bytes([mask, low & mask]) + codes.tobytes()


def _encode_chunk(
    values: np.ndarray, dtype: str, layout: str, config: CodecConfig
) -> tuple[Frame, ...]:
    frames = []
    for plane in LAYOUTS[layout].split(values, dtype):
        raw = plane.tobytes()
        packed = bitpack(plane)
        fast = (
            Frame(raw, "raw")
            if packed is None or len(packed) >= len(raw)
            else Frame(packed, "bitpack")
        )
        coded = _compressor(config, layout).compress(raw)
        # A frame that saves little over its fast form decodes at zstd's speed (near
        # 1 GB/s for Huffman-coded bytes) for few bytes; the fast form decodes at
        # memory speed.
        saved = len(fast.data) - len(coded)
        frames.append(
            Frame(coded, "zstd") if saved > 0 and saved >= config.raw_below * len(raw) else fast
        )
    return tuple(frames)


def encode_weight(
    weight: torch.Tensor, config: CodecConfig | None = None, executor: Executor | None = None
) -> EncodedWeight:
    """Encode a weight losslessly into zstd, raw or bit-packed frames.

    Args:
        weight: (out_features, in_features) float32, bfloat16 or float16, any device.
        config: the level, layout, chunk size and raw threshold (default
            ``CodecConfig()``).
        executor: compresses the chunks in parallel (zstd releases the GIL); None: in
            the calling thread.

    Returns:
        EncodedWeight: the frames, chunk-major and plane-minor, with the weight's CRC-32.

    Raises:
        ZstdLinearError: ``weight`` is not a 2-D tensor of a supported dtype.
    """
    config = config or CodecConfig()
    if not isinstance(weight, torch.Tensor):
        raise ZstdLinearError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    name = dtype_name(weight.dtype)
    if weight.dim() != 2:
        raise ZstdLinearError(f"weight must be 2-D (out_features, in_features), got {weight.shape}")
    int_dtype = SUPPORTED_DTYPES[name][1]
    flat = weight.detach().to("cpu").contiguous().view(-1)
    # (numel,) raw bit patterns; torch cannot reinterpret an empty tensor's dtype
    values = (
        flat.view(torch.uint8).numpy().view(int_dtype) if flat.numel() else np.empty(0, int_dtype)
    )
    chunk_elems = max(1, config.chunk_bytes // int_dtype.itemsize)
    starts = range(0, max(values.size, 1), chunk_elems)
    layout = config.layout_for(name)

    def job(start: int) -> tuple[Frame, ...]:
        return _encode_chunk(values[start : start + chunk_elems], name, layout, config)

    chunks: Iterable[tuple[Frame, ...]]
    chunks = executor.map(job, starts) if executor is not None else map(job, starts)
    return EncodedWeight(
        dtype=name,
        shape=tuple(weight.shape),
        layout=layout,
        level=config.level,
        chunk_elems=chunk_elems,
        frames=tuple(chunks),
        crc32=zlib.crc32(values),
    )
