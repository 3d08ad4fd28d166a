"""Parallel decoding of an EncodedWeight straight into caller-owned memory.

Each chunk is one task: its zstd frames are decoded with
``ZstdDecompressor().stream_reader(frame).readinto(buf)`` (which releases the GIL)
into per-thread scratch planes, then joined by the C core (``_core.join_planes``, one
call per chunk, which releases it too) into the chunk's slice of the output; a raw frame
is joined straight from its bytes (the file's mapping), without a copy, and a bit-packed
frame is unpacked by the C core (``_core.unpack_bits``) into a scratch plane. Scratch and
decompressors are per thread and reused, so a decode allocates no buffer the size of a
weight.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch
import zstandard

from zstd_linear._core import join_planes, unpack_bits
from zstd_linear.codec import EncodedWeight, view_weight
from zstd_linear.errors import CompressedFileError
from zstd_linear.layout import LAYOUTS


class DecodeError(CompressedFileError):
    """A frame did not decode to the size its chunk needs (corrupt data)."""


def default_threads() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def check_threads(threads: int | None) -> int:
    """``threads`` itself (None -> default_threads()); ValueError unless an int >= 1."""
    threads = default_threads() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    return threads


class _Scratch(threading.local):
    def __init__(self):
        self.decompressor = zstandard.ZstdDecompressor()
        self.buffers: dict[tuple[int, str], np.ndarray] = {}

    def get(self, n: int, dtype: np.dtype, slot: int) -> np.ndarray:
        key = (slot, dtype.str)
        buf = self.buffers.get(key)
        if buf is None or buf.size < n:
            buf = self.buffers[key] = np.empty(n, dtype=dtype)
        return buf[:n]


def _read_frame(decompressor: zstandard.ZstdDecompressor, data: bytes, out: np.ndarray) -> None:
    view = memoryview(out).cast("B")
    reader = decompressor.stream_reader(data)
    filled = 0
    try:
        while filled < len(view):
            n = reader.readinto(view[filled:])
            if n == 0:
                break
            filled += n
        extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"a zstd frame does not decode: {exc}") from None
    if filled != len(view) or extra:
        raise DecodeError(f"a zstd frame decoded to the wrong size (expected {len(view)} bytes)")


def _unpack_frame(data, out: np.ndarray) -> None:
    try:
        unpack_bits(data, out)
    except ValueError as exc:
        raise DecodeError(
            f"a bit-packed frame does not decode to {out.size} bytes: {exc}"
        ) from None


class Decoder:
    """Decodes EncodedWeights with ``threads`` worker threads (1 = in the calling thread)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads = check_threads(threads)
        self._scratch = _Scratch()
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="zstd-linear-decode")
            if threads > 1
            else None
        )

    def decode_into(self, encoded: EncodedWeight, out: torch.Tensor) -> None:
        """Decode ``encoded`` into ``out``: (original_bytes,) uint8 contiguous CPU tensor."""
        self.decode_many([(encoded, out)])

    def decode_many(self, pairs: Iterable[tuple[EncodedWeight, torch.Tensor]]) -> None:
        """Decode several weights at once, each into its ``out`` (as ``decode_into``).

        Every chunk of every weight is one task for the threads, so weights of one chunk
        (up to 1 MiB by default) decode in parallel too, which one ``decode_into`` at a
        time cannot do. Every ``out`` is checked before anything is decoded; on an error
        the other tasks finish, then the first error is raised.
        """
        pairs = list(pairs)
        tasks = []
        for encoded, out in pairs:
            if (
                not isinstance(out, torch.Tensor)
                or out.dtype != torch.uint8
                or out.numel() != encoded.original_bytes
            ):
                got = (
                    f"{out.dtype} of {out.numel()}"
                    if isinstance(out, torch.Tensor)
                    else type(out).__name__
                )
                raise ValueError(
                    f"out must be a uint8 tensor of {encoded.original_bytes} bytes, got {got}"
                )
            target, width = out.numpy(), encoded.itemsize
            for c in range(len(encoded.frames)):
                start, stop = encoded.chunk_range(c)
                tasks.append((encoded, c, target[start * width : stop * width]))
        self._run(tasks)

    def decode_chunks_into(self, encoded: EncodedWeight, chunks: range, out: torch.Tensor) -> None:
        """Decode the consecutive chunks ``chunks`` (a range with step 1) of ``encoded``
        into ``out``: a uint8 CPU tensor of exactly their bytes (elements
        ``chunk_range(chunks[0])[0]`` up to ``chunk_range(chunks[-1])[1]``, row-major),
        the chunks shared among the threads."""
        n = len(encoded.frames)
        if not (
            isinstance(chunks, range) and chunks.step == 1 and 0 <= chunks.start < chunks.stop <= n
        ):
            raise ValueError(
                f"chunks must be a non-empty range(a, b) within 0..{n}, got {chunks!r}"
            )
        first, last = encoded.span_range(chunks)
        width = encoded.itemsize
        nbytes = (last - first) * width
        if out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous uint8 tensor of {nbytes} bytes, got {out.dtype} "
                f"of {out.numel()}"
            )
        target = out.numpy()
        tasks = []
        for c in chunks:
            start, stop = encoded.chunk_range(c)
            tasks.append((encoded, c, target[(start - first) * width : (stop - first) * width]))
        self._run(tasks)

    def _run(self, tasks: list) -> None:
        """Decode ``tasks`` ((encoded, chunk, destination) each) on the threads; on an
        error the other tasks finish, then the first error is raised."""
        if self._pool is None or len(tasks) == 1:
            for task in tasks:
                self._decode_chunk(*task)
            return
        futures = [self._pool.submit(self._decode_chunk, *task) for task in tasks]
        wait(futures)
        for future in futures:
            future.result()

    def decode_chunk_into(self, encoded: EncodedWeight, c: int, out: torch.Tensor) -> None:
        """Decode chunk ``c`` alone into ``out``: a uint8 CPU tensor of exactly the chunk's
        bytes (elements ``encoded.chunk_range(c)``, row-major), in the calling thread."""
        if not 0 <= c < len(encoded.frames):
            raise ValueError(f"chunk must be in 0..{len(encoded.frames) - 1}, got {c}")
        start, stop = encoded.chunk_range(c)
        nbytes = (stop - start) * encoded.itemsize
        if out.dtype != torch.uint8 or out.numel() != nbytes:
            raise ValueError(
                f"out must be a uint8 tensor of {nbytes} bytes, got {out.dtype} of {out.numel()}"
            )
        self._decode_chunk(encoded, c, out.numpy())

    def decode(self, encoded: EncodedWeight) -> torch.Tensor:
        """A freshly allocated decoded weight, shape ``encoded.shape``, its dtype."""
        out = torch.empty(encoded.original_bytes, dtype=torch.uint8)
        self.decode_into(encoded, out)
        return view_weight(out, encoded)

    def _decode_chunk(self, encoded: EncodedWeight, c: int, dst: np.ndarray) -> None:
        start, stop = encoded.chunk_range(c)  # dst: (E * width,) uint8, the chunk's bytes
        n = stop - start
        layout = LAYOUTS[encoded.layout]
        scratch = self._scratch
        frames = encoded.frames[c]
        if not layout.planes:
            frame = frames[0]
            if frame.kind == "raw":
                if len(frame.data) != dst.size:
                    raise DecodeError(f"a raw frame holds {len(frame.data)} bytes, not {dst.size}")
                np.copyto(dst, np.frombuffer(frame.data, dtype=np.uint8))
            elif frame.kind == "bitpack":
                _unpack_frame(frame.data, dst)
            else:
                _read_frame(scratch.decompressor, frame.data, dst)
            return
        planes: list[np.ndarray | bytes | memoryview] = []
        for p, frame in enumerate(frames):
            if frame.kind == "raw":
                if len(frame.data) != n:
                    raise DecodeError(f"a raw frame holds {len(frame.data)} bytes, not {n}")
                planes.append(frame.data)  # joined straight from the file's mapping
                continue
            plane = scratch.get(n, np.dtype(np.uint8), p)
            if frame.kind == "bitpack":
                _unpack_frame(frame.data, plane)
            else:
                _read_frame(scratch.decompressor, frame.data, plane)
            planes.append(plane)
        join_planes(planes, dst, layout.rotation[encoded.dtype])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
