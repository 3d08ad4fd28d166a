"""Parallel decoding of an EncodedWeight straight into caller-owned memory.

The C backend (the default) decodes a run of chunks in one call into the C core
(``zl_decode_chunks``), with the GIL released: per chunk, its zstd frames are decoded by
libzstd (``ZSTD_decompressDCtx``, taken from python-zstandard's bundled libzstd through its
cffi module) and bit-packed planes unpacked into per-thread scratch planes, then joined
into the chunk's slice of the output; a raw plane is joined straight from its bytes (the
file's mapping), without a copy. Python runs once per weight and thread, not per chunk:
a decode splits its chunks into one contiguous run per thread. Each weight's table of
frame pointers is built once, on its first decode, and kept with it.

The Python backend (where python-zstandard has no cffi module, or on request) does the
same per chunk with ``ZstdDecompressor().stream_reader(frame).readinto(buf)`` and the C
core's join: 0.8's decoder. Both give the same bytes. Scratch and decompression
contexts are per thread and reused, so a decode allocates no buffer the size of a weight.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch
import zstandard

from zstd_linear._core import ffi, join_planes, lib, unpack_bits
from zstd_linear.codec import FRAME_KINDS, EncodedWeight, view_weight
from zstd_linear.errors import CompressedFileError, ZstdLinearError
from zstd_linear.layout import LAYOUTS


class DecodeError(CompressedFileError):
    """A frame did not decode to the size its chunk needs (corrupt data)."""


def default_threads() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def check_threads(threads: int | None) -> int:
    """``threads`` itself (None -> default_threads()); ZstdLinearError unless an int >= 1."""
    threads = default_threads() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ZstdLinearError(f"threads must be an int >= 1, got {threads!r}")
    return threads


try:  # libzstd's own functions, from python-zstandard's cffi module (the same libzstd)
    from zstandard import _cffi as _zstd_cffi
except ImportError:  # pragma: no cover - python-zstandard builds without its cffi module
    _zstd_cffi = None

BACKENDS = ("auto", "c", "python")


def c_backend_available() -> bool:
    """Whether python-zstandard exposes libzstd through its cffi module (the C backend)."""
    return _zstd_cffi is not None


def _address(cdata) -> int:
    return int(_zstd_cffi.ffi.cast("uintptr_t", cdata))


_ZSTD = None


def _zstd_functions():
    """The ``zl_zstd`` table of libzstd's functions the C core calls (built once)."""
    global _ZSTD
    if _ZSTD is None:
        zlib_ = _zstd_cffi.lib
        _ZSTD = ffi.new(
            "zl_zstd *",
            [
                ffi.cast(
                    "zl_zstd_decompress_fn",
                    _address(_zstd_cffi.ffi.addressof(zlib_, "ZSTD_decompressDCtx")),
                ),
                ffi.cast(
                    "zl_zstd_is_error_fn", _address(_zstd_cffi.ffi.addressof(zlib_, "ZSTD_isError"))
                ),
            ],
        )
    return _ZSTD


def _zstd_error_name(code: int) -> str | None:
    """libzstd's name for ``code`` when it is an error code, else None."""
    if not _zstd_cffi.lib.ZSTD_isError(code):
        return None
    return _zstd_cffi.ffi.string(_zstd_cffi.lib.ZSTD_getErrorName(code)).decode()


class _ChunkTable:
    """An EncodedWeight's frames as a C array of ``zl_chunk``: the addresses of the
    frames' bytes, valid while the EncodedWeight (which holds the frames, and through a
    file's frames its mapping) lives; the table is dropped when it dies.

    The addresses are read through ``ffi.from_buffer`` and the buffer released at once.
    Holding one exported buffer per frame would tie the table to the mapping's
    memoryviews, and CPython's cycle collector can clear such a memoryview before the
    export that holds it is released (a crash in ``memory_dealloc``).
    """

    def __init__(self, encoded: EncodedWeight):
        self.width = width = encoded.itemsize
        self.planes = LAYOUTS[encoded.layout].planes
        self.rotation = LAYOUTS[encoded.layout].rotation[encoded.dtype] if self.planes else 0
        self.chunks = ffi.new("zl_chunk[]", len(encoded.frames))
        self.scratch_bytes = 0
        # Each chunk's frames' address range; a file's frames are hinted before a decode.
        self.file_backed = all(f.file_backed for chunk in encoded.frames for f in chunk)
        self.lo: list[int] = []
        self.hi: list[int] = []
        for c, frames in enumerate(encoded.frames):
            _check_frames(encoded, c)
            start, stop = encoded.chunk_range(c)
            chunk = self.chunks[c]
            chunk.offset, chunk.n = start * width, stop - start
            if self.planes:
                self.scratch_bytes = max(self.scratch_bytes, (stop - start) * width)
            spans = []
            for p, frame in enumerate(frames):
                with ffi.from_buffer("uint8_t[]", frame.data) as data:
                    address = int(ffi.cast("uintptr_t", data))
                    chunk.frames[p].data = ffi.cast("uint8_t *", address)
                    chunk.frames[p].size = len(data)
                spans.append((address, address + len(frame.data)))
                chunk.frames[p].kind = FRAME_KINDS.index(frame.kind)
            self.lo.append(min(lo for lo, _ in spans))
            self.hi.append(max(hi for _, hi in spans))

    def will_need(self, chunks: range) -> None:
        """Have the kernel read the frames of ``chunks`` from the file now, in one
        request over their address range (a no-op for frames in anonymous memory).

        The file's mapping is read at random (``MADV_RANDOM``, set by ``read_file``): a
        page fault reads its page only. Without that, every fault on an evicted page
        read up to the disk's read-ahead around it (8 MiB here); under a hard limit
        that left ~70 MiB of page cache, SmolLM2 read 6.4 GB per token instead of its
        268 MB of frames."""
        if self.file_backed:
            lo, hi = (
                min(self.lo[chunks.start : chunks.stop]),
                max(self.hi[chunks.start : chunks.stop]),
            )
            lib.zl_will_need(ffi.cast("void *", lo), hi - lo)

    def page_out(self, chunks: range) -> int:
        """Drop the frames of ``chunks`` from the page cache now (``zl_page_out``: the
        whole pages of their address range; a no-op returning 0 for frames in anonymous
        memory). Returns 0, or what ``zl_page_out`` returned."""
        if not self.file_backed:
            return 0
        lo, hi = min(self.lo[chunks.start : chunks.stop]), max(self.hi[chunks.start : chunks.stop])
        return lib.zl_page_out(ffi.cast("void *", lo), hi - lo)

    @staticmethod
    def of(encoded: EncodedWeight) -> _ChunkTable:
        """The table of ``encoded``, built on first use and kept until ``encoded`` is
        freed. Kept beside it, by id, not in it: an EncodedWeight is frozen, compares by
        its fields, and ``EncodedWeight(**other.__dict__)`` must stay a copy of its
        fields."""
        table = _TABLES.get(id(encoded))
        if table is None:
            table = _TABLES[id(encoded)] = _ChunkTable(encoded)
            weakref.finalize(encoded, _TABLES.pop, id(encoded), None)
        return table


#: _ChunkTable.of's tables, by the id of their EncodedWeight (each dropped when it dies).
_TABLES: dict[int, _ChunkTable] = {}


class _Scratch(threading.local):
    def __init__(self):
        self.decompressor = zstandard.ZstdDecompressor()
        self.buffers: dict[tuple[int, str], np.ndarray] = {}
        self.dctx = None  # the C backend's: a libzstd ZSTD_DCtx and its void * for the core
        self.status = ffi.new("size_t[2]")  # zl_decode_chunks' failed, detail

    def context(self):
        if self.dctx is None:
            dctx = _zstd_cffi.lib.ZSTD_createDCtx()
            if dctx == _zstd_cffi.ffi.NULL:
                raise MemoryError("libzstd could not allocate a decompression context")
            self.dctx = _zstd_cffi.ffi.gc(dctx, _zstd_cffi.lib.ZSTD_freeDCtx)
            self.dctx_void = ffi.cast("void *", _address(self.dctx))
        return self.dctx_void

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
    except ZstdLinearError as exc:
        raise DecodeError(
            f"a bit-packed frame does not decode to {out.size} bytes: {exc}"
        ) from None


class Decoder:
    """Decodes EncodedWeights on a pool of threads.

    Args:
        threads: decode threads, >= 1 (1: in the calling thread; default min(2, cores)).
        backend: ``"auto"`` (default: ``"c"`` where python-zstandard has its cffi
            module, else ``"python"``), ``"c"`` or ``"python"``; see the module
            docstring. ``self.backend`` says which one decodes; ``self.pages_out``
            whether ``page_out`` still drops frames (False once the platform refused).

    Raises:
        ZstdLinearError: a bad ``threads`` or ``backend``, or ``"c"`` where the cffi
            module is missing.
    """

    def __init__(self, threads: int | None = None, backend: str = "auto"):
        self.threads = threads = check_threads(threads)
        if backend not in BACKENDS:
            raise ZstdLinearError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "c" and not c_backend_available():
            raise ZstdLinearError(
                "backend 'c' needs python-zstandard's cffi module (zstandard._cffi), which "
                "this installation lacks; use backend='python'"
            )
        if backend == "auto":
            backend = "c" if c_backend_available() else "python"
        self.backend = backend
        # False once the platform refused a page-out (see page_out).
        self.pages_out = True
        self._scratch = _Scratch()
        # The C backend decodes one run in the calling thread and the others in the pool;
        # the Python backend hands every chunk to the pool.
        workers = threads - 1 if backend == "c" else threads
        self._pool = (
            ThreadPoolExecutor(workers, thread_name_prefix="zstd-linear-decode")
            if threads > 1
            else None
        )

    def decode_into(
        self, encoded: EncodedWeight, out: torch.Tensor, *, page_out: bool = False
    ) -> None:
        """Decode a weight into a buffer.

        Args:
            encoded: the weight.
            out: (original_bytes,) uint8, contiguous, on the CPU; ``view_weight`` reads
                it as the weight.
            page_out: then drop its frames from the page cache (``page_out``).

        Raises:
            ZstdLinearError: ``out`` is not such a tensor; nothing is decoded.
            DecodeError: a frame does not decode.
        """
        self._decode_pairs([(encoded, out)], page_out)

    def decode_many(self, pairs: Iterable[tuple[EncodedWeight, torch.Tensor]]) -> None:
        """Decode several weights at once, each into its ``out`` (as ``decode_into``).

        The chunks of all the weights are shared among the threads, so weights of one
        chunk (up to 256 KiB by default) decode in parallel too, which one ``decode_into``
        at a time cannot do. Every ``out`` is checked before anything is decoded; on an
        error the other chunks are decoded, then the first error is raised.

        Args:
            pairs: (EncodedWeight, out) pairs, each ``out`` as for ``decode_into``.

        Raises:
            ZstdLinearError: an ``out`` of the wrong dtype, size or layout.
            DecodeError: a frame does not decode.
        """
        self._decode_pairs(pairs, False)

    def _decode_pairs(
        self, pairs: Iterable[tuple[EncodedWeight, torch.Tensor]], page_out: bool
    ) -> None:
        pairs = list(pairs)
        segments = []
        for encoded, out in pairs:
            if (
                not isinstance(out, torch.Tensor)
                or out.dtype != torch.uint8
                or out.numel() != encoded.original_bytes
                or not out.is_contiguous()
            ):
                got = (
                    f"{out.dtype} of {out.numel()}"
                    if isinstance(out, torch.Tensor)
                    else type(out).__name__
                )
                raise ZstdLinearError(
                    f"out must be a uint8 tensor of {encoded.original_bytes} bytes, got {got}"
                )
            segments.append((encoded, range(len(encoded.frames)), out.numpy(), 0, page_out))
        self._run(segments)

    def decode_chunks_into(
        self, encoded: EncodedWeight, chunks: range, out: torch.Tensor, *, page_out: bool = False
    ) -> None:
        """Decode consecutive chunks of a weight, shared among the threads.

        Args:
            encoded: the weight.
            chunks: a non-empty range(a, b) of chunk indices, step 1.
            out: uint8, contiguous, on the CPU, exactly the chunks' bytes (elements
                ``encoded.span_range(chunks)``, row-major).
            page_out: then drop the chunks' frames from the page cache (``page_out``).

        Raises:
            ZstdLinearError: a bad ``chunks`` or ``out``; nothing is decoded.
            DecodeError: a frame does not decode.
        """
        n = len(encoded.frames)
        if not (
            isinstance(chunks, range) and chunks.step == 1 and 0 <= chunks.start < chunks.stop <= n
        ):
            raise ZstdLinearError(
                f"chunks must be a non-empty range(a, b) within 0..{n}, got {chunks!r}"
            )
        first, last = encoded.span_range(chunks)
        width = encoded.itemsize
        nbytes = (last - first) * width
        if out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous():
            raise ZstdLinearError(
                f"out must be a contiguous uint8 tensor of {nbytes} bytes, got {out.dtype} "
                f"of {out.numel()}"
            )
        self._run([(encoded, chunks, out.numpy(), first * width, page_out)])

    def decode_chunk_into(self, encoded: EncodedWeight, c: int, out: torch.Tensor) -> None:
        """Decode one chunk of a weight, in the calling thread.

        Args:
            encoded: the weight.
            c: the chunk index, 0..len(encoded.frames) - 1.
            out: uint8, contiguous, on the CPU, exactly the chunk's bytes (elements
                ``encoded.chunk_range(c)``, row-major).

        Raises:
            ZstdLinearError: a bad ``c`` or ``out``; nothing is decoded.
            DecodeError: a frame does not decode.
        """
        if not 0 <= c < len(encoded.frames):
            raise ZstdLinearError(f"chunk must be in 0..{len(encoded.frames) - 1}, got {c}")
        start, stop = encoded.chunk_range(c)
        nbytes = (stop - start) * encoded.itemsize
        if out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous():
            raise ZstdLinearError(
                f"out must be a uint8 tensor of {nbytes} bytes, got {out.dtype} of {out.numel()}"
            )
        self._decode_segment(encoded, range(c, c + 1), out.numpy(), start * encoded.itemsize)

    def will_need(self, encoded: EncodedWeight, chunks: range | None = None) -> None:
        """Have the kernel start reading a file-backed weight's frames now
        (``posix_madvise(WILLNEED)`` over their address range; it returns before the read
        completes), so that a later decode finds them in the page cache. Frames in
        anonymous memory are left alone. A policy asks for the layers it decodes next
        while this one decodes and computes (``PerPassPrefetch``'s ``read_ahead_bytes``).

        Args:
            encoded: the weight.
            chunks: a range(a, b) of its chunk indices, step 1; None: every chunk.
        """
        chunks = range(len(encoded.frames)) if chunks is None else chunks
        if len(chunks):
            _ChunkTable.of(encoded).will_need(chunks)

    def page_out(self, encoded: EncodedWeight, chunks: range) -> bool:
        """Drop the frames of a file-backed weight's ``chunks`` from the page cache
        (``madvise(MADV_PAGEOUT)``), once they are decoded and not needed until the next
        pass: under a hard memory limit that cannot cache every frame, the streamed
        frames then leave the page cache to the ones kept (``Budget``) instead of
        evicting them. Frames in anonymous memory are left alone.

        Where the platform cannot (no ``MADV_PAGEOUT``, Linux before 5.4), nothing is
        dropped and ``pages_out`` turns False for the rest of the decoder's life.

        Args:
            encoded: the weight.
            chunks: a range(a, b) of its chunk indices, step 1.

        Returns:
            Whether the frames were dropped (or are not file-backed).
        """
        if not self.pages_out or not len(chunks):
            return False
        code = _ChunkTable.of(encoded).page_out(chunks)
        if code != 0:
            self.pages_out = False
        return code == 0

    def decode(self, encoded: EncodedWeight) -> torch.Tensor:
        """Decode a weight into a new tensor.

        Args:
            encoded: the weight.

        Returns:
            The weight, shape ``encoded.shape``, its dtype, freshly allocated.

        Raises:
            DecodeError: a frame does not decode.
        """
        out = torch.empty(encoded.original_bytes, dtype=torch.uint8)
        self.decode_into(encoded, out)
        return view_weight(out, encoded)

    def _run(self, segments: list) -> None:
        """Decode ``segments`` ((encoded, chunks, target, origin, page_out) each:
        ``target`` holds the weight's bytes from byte ``origin`` on; with ``page_out``
        each thread drops the frames it decoded) on the threads, one contiguous run of
        chunks per thread (the Python backend: one task per chunk); on an error the other
        chunks are decoded, then the first error is raised."""
        if self.backend == "python":
            segments = [
                (encoded, range(c, c + 1), target, origin, drop)
                for encoded, chunks, target, origin, drop in segments
                for c in chunks
            ]
            runs = [[segment] for segment in segments]
        else:
            runs = _split_runs(segments, self.threads)
        if self._pool is None or len(runs) == 1:
            errors = [self._decode_run(run) for run in runs]
        else:
            # The C backend's calling thread decodes the first run: one hand-off fewer.
            mine, theirs = (runs[0], runs[1:]) if self.backend == "c" else ([], runs)
            futures = [self._pool.submit(self._decode_run, run) for run in theirs]
            errors = [self._decode_run(mine)]
            wait(futures)
            errors += [future.result() for future in futures]
        for error in errors:
            if error is not None:
                raise error

    def _decode_run(self, run: list) -> DecodeError | None:
        """Decode every segment of ``run``; the first DecodeError, returned, not raised."""
        first = None
        for segment in run:
            try:
                self._decode_segment(*segment)
            except DecodeError as exc:
                first = first or exc
        return first

    def _decode_segment(
        self,
        encoded: EncodedWeight,
        chunks: range,
        target: np.ndarray,
        origin: int,
        page_out: bool = False,
    ) -> None:
        """Decode ``chunks`` of ``encoded`` into ``target`` (the weight's bytes from byte
        ``origin`` on); on an error the segment's other chunks are decoded, then the first
        error is raised. With ``page_out``, then drop their frames (``page_out``): from
        the thread that read them, whose CPU still holds the newest of those pages in its
        batch of pages not yet on the kernel's LRU lists, which a page-out from another
        CPU would skip."""
        try:
            self._decode_chunks(encoded, chunks, target, origin)
        finally:
            if page_out:
                self.page_out(encoded, chunks)

    def _decode_chunks(
        self, encoded: EncodedWeight, chunks: range, target: np.ndarray, origin: int
    ) -> None:
        if self.backend == "python":
            width = encoded.itemsize
            for c in chunks:
                start, stop = encoded.chunk_range(c)
                try:
                    self._decode_chunk(
                        encoded, c, target[start * width - origin : stop * width - origin]
                    )
                except DecodeError as exc:
                    if str(exc).startswith("chunk "):
                        raise
                    raise DecodeError(f"chunk {c}: {exc}") from None
            return
        table = _ChunkTable.of(encoded)
        table.will_need(chunks)
        scratch = self._scratch
        planes = scratch.get(table.scratch_bytes, np.dtype(np.uint8), -1)
        with (
            ffi.from_buffer("uint8_t[]", target, require_writable=True) as out,
            ffi.from_buffer("uint8_t[]", planes, require_writable=True) as plane_ptr,
        ):
            first_error = self._decode_table(encoded, table, chunks, out, origin, plane_ptr)
        if first_error is not None:
            raise first_error

    def _decode_table(
        self, encoded: EncodedWeight, table: _ChunkTable, chunks: range, out, origin: int, plane_ptr
    ) -> DecodeError | None:
        """``zl_decode_chunks`` over ``chunks`` into ``out`` (cdata), resuming after each
        failed chunk; the first DecodeError, returned."""
        scratch = self._scratch
        status = scratch.status
        first_error, c = None, chunks.start
        while c < chunks.stop:
            code = lib.zl_decode_chunks(
                _zstd_functions(),
                scratch.context(),
                table.width,
                int(table.planes),
                table.rotation,
                table.chunks + c,
                chunks.stop - c,
                out,
                origin,
                len(out),
                plane_ptr,
                len(plane_ptr),
                status,
                status + 1,
            )
            if code == lib.ZL_OK:
                break
            failed = c + int(status[0])
            first_error = first_error or _chunk_error(encoded, failed, code, int(status[1]))
            c = failed + 1
        return first_error

    def _decode_chunk(self, encoded: EncodedWeight, c: int, dst: np.ndarray) -> None:
        start, stop = encoded.chunk_range(c)  # dst: (E * width,) uint8, the chunk's bytes
        n = stop - start
        layout = LAYOUTS[encoded.layout]
        scratch = self._scratch
        frames = encoded.frames[c]
        _check_frames(encoded, c)
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
        """Shut the thread pool down, waiting for running decodes."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _split_runs(segments: list, threads: int) -> list[list]:
    """``segments`` cut into at most ``threads`` runs of consecutive chunks, each about
    the same number of decoded bytes; a segment may be cut between two runs. Computed
    per segment and run, not per chunk: a weight's chunks all hold ``chunk_elems``
    elements but its last."""
    if threads == 1 or sum(len(segment[1]) for segment in segments) <= 1:
        return [segments]
    total = sum(encoded.span_bytes(chunks) for encoded, chunks, *_ in segments)
    runs, run, done, k = [], [], 0, 1
    for encoded, chunks, *rest in segments:
        step = encoded.chunk_elems * encoded.itemsize
        start = chunks.start
        while start < chunks.stop:
            goal = total * k / threads  # decoded bytes at the end of run k
            stop = chunks.stop
            if k < threads:
                stop = min(stop, start + max(1, math.ceil((goal - done) / step)))
            part = range(start, stop)
            run.append((encoded, part, *rest))
            done += encoded.span_bytes(part)
            start = stop
            if k < threads and done >= goal:
                runs.append(run)
                run, k = [], k + 1
    if run:
        runs.append(run)
    return runs


def _check_frames(encoded: EncodedWeight, c: int) -> None:
    """DecodeError unless chunk ``c`` holds as many frames as its layout has planes."""
    needed = LAYOUTS[encoded.layout].n_planes(encoded.dtype)
    if len(encoded.frames[c]) != needed:
        raise DecodeError(
            f"chunk {c} holds {len(encoded.frames[c])} frames; its layout "
            f"{encoded.layout!r} ({encoded.dtype}) needs {needed}"
        )


def _chunk_error(encoded: EncodedWeight, c: int, code: int, detail: int) -> DecodeError:
    """The DecodeError for ``zl_decode_chunks``' ``code`` on chunk ``c`` of ``encoded``."""
    start, stop = encoded.chunk_range(c)
    n = stop - start
    if code == lib.ZL_ERR_FRAME:
        name = _zstd_error_name(detail)
        if name is not None:
            return DecodeError(f"a zstd frame of chunk {c} does not decode: {name}")
        return DecodeError(
            f"a frame of chunk {c} holds or decodes to {detail} bytes, not the "
            f"{n * (encoded.itemsize if not LAYOUTS[encoded.layout].planes else 1)} its "
            "plane needs (a zstd frame or a raw frame of the wrong size)"
        )
    if code in (lib.ZL_ERR_DATA, lib.ZL_ERR_SIZE):
        return DecodeError(f"a bit-packed frame of chunk {c} does not decode to {n} bytes")
    return DecodeError(f"chunk {c} does not decode: zl_decode_chunks returned {code}")
