"""The decoder's backends: the C one (the default) decodes a run of chunks per C call,
one run per thread, and gives the Python one's bytes; both turn every kind of bad frame
into a DecodeError and still decode the other chunks; the core's ``zl_decode_chunks``
rejects bad input before it writes; a file's chunk tables survive the cycle collector."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from zstd_linear import decoder as decoder_module
from zstd_linear._core import ffi, lib
from zstd_linear.codec import CodecConfig, EncodedWeight, Frame, encode_weight, view_weight
from zstd_linear.decoder import (
    DecodeError,
    Decoder,
    _ChunkTable,
    _Scratch,
    _split_runs,
    _zstd_functions,
)
from zstd_linear.errors import ZstdLinearError


def _bytes(w: torch.Tensor) -> np.ndarray:
    return w.contiguous().view(-1).view(torch.uint8).numpy()


def test_the_c_backend_is_the_default_and_a_bad_backend_is_named(monkeypatch):
    assert decoder_module.c_backend_available()
    assert Decoder(1).backend == "c"
    assert Decoder(1, backend="python").backend == "python"
    with pytest.raises(ZstdLinearError, match="backend must be one of"):
        Decoder(1, backend="rust")
    monkeypatch.setattr(decoder_module, "_zstd_cffi", None)  # a zstandard without cffi
    assert Decoder(1).backend == "python"
    with pytest.raises(ZstdLinearError, match=r"zstandard\._cffi"):
        Decoder(1, backend="c")


@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_backend_runs_python_once_per_thread_not_per_chunk(threads, monkeypatch):
    weights = [torch.randn(256, 128), torch.randn(64, 64).to(torch.bfloat16)]
    encoded = [encode_weight(w, CodecConfig(chunk_bytes=4096)) for w in weights]
    assert [len(e.frames) for e in encoded] == [32, 2]
    segments = []
    original = Decoder._decode_segment

    def spy(self, enc, chunks, target, origin, *page_out):
        segments.append((enc, chunks))
        return original(self, enc, chunks, target, origin, *page_out)

    monkeypatch.setattr(Decoder, "_decode_segment", spy)
    decoder = Decoder(threads)
    out = torch.empty(encoded[0].original_bytes, dtype=torch.uint8)
    decoder.decode_into(encoded[0], out)
    assert np.array_equal(out.numpy(), _bytes(weights[0]))
    assert len(segments) == threads  # one C call per thread for 32 chunks
    assert sorted(c for _, chunks in segments for c in chunks) == list(range(32))
    segments.clear()
    outs = [torch.empty(e.original_bytes, dtype=torch.uint8) for e in encoded]
    decoder.decode_many(zip(encoded, outs, strict=True))
    assert all(np.array_equal(o.numpy(), _bytes(w)) for o, w in zip(outs, weights, strict=True))
    # at most one segment per weight and thread, plus one where a weight is cut
    assert len(segments) <= len(encoded) + threads - 1
    segments.clear()
    Decoder(threads, backend="python").decode_into(encoded[0], out)
    assert len(segments) == 32  # the Python backend: one task per chunk
    decoder.close()


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_runs_cover_every_chunk_once_in_order_with_balanced_bytes(threads):
    encoded = [
        encode_weight(torch.randn(n, 64), CodecConfig(chunk_bytes=4096)) for n in (48, 5, 100)
    ]
    targets = [np.empty(e.original_bytes, np.uint8) for e in encoded]
    segments = [(e, range(len(e.frames)), t, 0) for e, t in zip(encoded, targets, strict=True)]
    runs = _split_runs(segments, threads)
    assert 1 < len(runs) <= threads
    flat = [(id(e), c) for run in runs for e, chunks, _, _ in run for c in chunks]
    assert flat == [(id(e), c) for e in encoded for c in range(len(e.frames))]
    total = sum(e.original_bytes for e in encoded)
    for run in runs:
        got = sum(
            (e.chunk_range(chunks.stop - 1)[1] - e.chunk_range(chunks.start)[0]) * 4
            for e, chunks, _, _ in run
        )
        assert abs(got - total / threads) <= 4096  # within one chunk of an equal share


def _damage(encoded: EncodedWeight, c: int, p: int, frame: Frame) -> EncodedWeight:
    chunks = list(encoded.frames)
    frames = list(chunks[c])
    frames[p] = frame
    chunks[c] = tuple(frames)
    return EncodedWeight(**{**encoded.__dict__, "frames": tuple(chunks)})


def _bad_frames(encoded: EncodedWeight, c: int):
    """(label, plane, frame, message) for each kind of bad frame in chunk c."""
    n = encoded.chunk_range(c)[1] - encoded.chunk_range(c)[0]
    zstd_plane = next(p for p, f in enumerate(encoded.frames[c]) if f.kind == "zstd")
    raw_plane = next(p for p, f in enumerate(encoded.frames[c]) if f.kind == "raw")
    compress = zstandard.ZstdCompressor().compress
    return [
        ("corrupt zstd", zstd_plane, Frame(b"\x28\xb5\x2f\xfd" + bytes(20), "zstd"), "zstd frame"),
        ("zstd too short", zstd_plane, Frame(compress(bytes(n - 1)), "zstd"), "size|bytes"),
        ("zstd too long", zstd_plane, Frame(compress(bytes(n + 1)), "zstd"), "zstd frame"),
        ("raw too short", raw_plane, Frame(bytes(n - 1), "raw"), f"{n - 1} bytes"),
        ("bitpack mask 0", raw_plane, Frame(bytes(2 + n), "bitpack"), "bit-packed"),
        ("bitpack short", raw_plane, Frame(bytes([0x80, 0]) + bytes(3), "bitpack"), "bit-packed"),
    ]


@pytest.mark.parametrize("backend", ["c", "python"])
@pytest.mark.parametrize("case", range(6))
def test_a_bad_frame_is_a_decode_error_and_the_other_chunks_decode(backend, case):
    w = torch.randn(64, 64) * 0.02
    encoded = encode_weight(w, CodecConfig(chunk_bytes=4096))  # 4 chunks
    _, plane, frame, message = _bad_frames(encoded, 1)[case]
    broken = _damage(encoded, 1, plane, frame)
    out = torch.full((encoded.original_bytes,), 7, dtype=torch.uint8)
    decoder = Decoder(2, backend=backend)
    with pytest.raises(DecodeError, match=message) as error:
        decoder.decode_into(broken, out)
    assert "chunk 1" in str(error.value)  # which chunk, in both backends
    whole = _bytes(w)
    for c in (0, 2, 3):
        start, stop = encoded.chunk_range(c)
        assert np.array_equal(out.numpy()[start * 4 : stop * 4], whole[start * 4 : stop * 4])
    decoder.close()


@pytest.mark.parametrize("backend", ["c", "python"])
def test_a_chunk_with_the_wrong_number_of_frames_is_a_decode_error(backend):
    encoded = encode_weight(torch.randn(32, 32), CodecConfig(chunk_bytes=4096))
    chunks = list(encoded.frames)
    chunks[0] = chunks[0][:3]
    broken = EncodedWeight(**{**encoded.__dict__, "frames": tuple(chunks)})
    with pytest.raises(DecodeError, match="chunk 0 holds 3 frames; its layout 'exponent'"):
        Decoder(1, backend=backend).decode(broken)


def _decode_chunks(table, out, *, width=None, rotation=None, scratch=None, origin=0, count=None):
    scratch = np.empty(table.scratch_bytes, np.uint8) if scratch is None else scratch
    status = ffi.new("size_t[2]")
    holder = _Scratch()  # owns the decompression context for the call
    code = lib.zl_decode_chunks(
        _zstd_functions(),
        holder.context(),
        table.width if width is None else width,
        int(table.planes),
        table.rotation if rotation is None else rotation,
        table.chunks,
        len(table.chunks) if count is None else count,
        ffi.from_buffer("uint8_t[]", out, require_writable=True),
        origin,
        out.size,
        ffi.from_buffer("uint8_t[]", scratch, require_writable=True),
        scratch.size,
        status,
        status + 1,
    )
    return code, int(status[0]), int(status[1])


def test_zl_decode_chunks_rejects_bad_input_before_writing():
    w = torch.randn(16, 256)
    encoded = encode_weight(w, CodecConfig(chunk_bytes=4096))  # 4 chunks
    table = _ChunkTable.of(encoded)
    out = np.full(encoded.original_bytes, 7, np.uint8)
    assert _decode_chunks(table, out) == (lib.ZL_OK, 4, 0)
    assert np.array_equal(out, _bytes(w))
    for kwargs, code in [
        ({"width": 3}, lib.ZL_ERR_WIDTH),
        ({"rotation": 32}, lib.ZL_ERR_ROTATION),
        ({"rotation": -1}, lib.ZL_ERR_ROTATION),
        ({"scratch": np.empty(4095, np.uint8)}, lib.ZL_ERR_SIZE),
    ]:
        out[:] = 7
        assert _decode_chunks(table, out, **kwargs)[0] == code, kwargs
        assert (out == 7).all(), kwargs
    # an output that ends inside chunk 2: chunks 0 and 1 decode, chunk 2 is refused
    short = np.full(2 * 4096 + 100, 7, np.uint8)
    assert _decode_chunks(table, short) == (lib.ZL_ERR_SIZE, 2, 0)
    assert np.array_equal(short[: 2 * 4096], _bytes(w)[: 2 * 4096]) and (short[8192:] == 7).all()
    # an origin past a chunk's start: that chunk lies before the output
    assert _decode_chunks(table, out, origin=4096)[:2] == (lib.ZL_ERR_SIZE, 0)
    # an unknown frame kind
    table.chunks[3].frames[0].kind = 9
    out[:] = 7
    assert _decode_chunks(table, out)[:2] == (lib.ZL_ERR_DATA, 3)
    assert (out[3 * 4096 :] == 7).all()


def test_chunk_tables_of_a_mapped_file_survive_the_cycle_collector(tmp_path):
    """A first version of the C backend held one exported buffer per frame of the file's
    mapping: collecting such a table in a reference cycle raised BufferError in
    gc.collect() (and crashed in memory_dealloc in test_cli's sequence)."""
    script = textwrap.dedent(
        f"""
        import gc
        import torch
        from zstd_linear.codec import CodecConfig, encode_weight
        from zstd_linear.decoder import Decoder
        from zstd_linear.decoder import _ChunkTable, _TABLES
        from zstd_linear.fileformat import read_file, write_file

        path = {str(tmp_path / "w.zlin")!r}
        weights = [torch.randn(64, 64) for _ in range(4)]
        write_file(path, [
            (f"w{{i}}", encode_weight(w, CodecConfig(chunk_bytes=4096)), None)
            for i, w in enumerate(weights)
        ])
        for _ in range(3):
            entries = read_file(path)
            decoder = Decoder(2)
            for (_, encoded, _), w in zip(entries, weights):
                assert torch.equal(decoder.decode(encoded), w)
            decoder.close()
            for _, encoded, _ in entries:  # each table in a cycle of its own, too
                table = _ChunkTable.of(encoded)
                table.cycle = table
            cycle = {{"entries": entries}}
            cycle["self"] = cycle
            del entries, encoded, cycle, table
            gc.collect()
            assert not _TABLES, len(_TABLES)  # every table dropped with its weight
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_weights_table_is_its_own_and_leaves_its_fields_alone():
    """The table is kept beside the EncodedWeight, not in its ``__dict__``: a copy built
    from another's fields with other frames decodes its own frames."""
    wa, wb = torch.randn(32, 32), torch.randn(32, 32)
    a, b = (encode_weight(w, CodecConfig(chunk_bytes=4096)) for w in (wa, wb))
    decoder = Decoder(1)
    assert torch.equal(decoder.decode(a), wa)
    copy = EncodedWeight(**{**a.__dict__, "frames": b.frames, "crc32": b.crc32})
    assert torch.equal(decoder.decode(copy), wb)
    assert torch.equal(decoder.decode(a), wa)


def _resident_pages(mapping_address: int, length: int) -> np.ndarray:
    """mincore(2): which pages of [address, address + length) are in the page cache."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    assert libc.mincore(ctypes.c_void_p(mapping_address), ctypes.c_size_t(length), vec) == 0
    return np.frombuffer(bytes(vec), np.uint8) & 1


def _uncached_random_mapping(path: Path, size: int, seed: int):
    """A file of ``size`` random bytes, synced and out of the page cache, mapped read-only
    and MADV_RANDOM (as read_file leaves a .zlin mapping): (mapping, view, address)."""
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes())
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapping.madvise(mmap.MADV_RANDOM)
    view = memoryview(mapping)
    with ffi.from_buffer("uint8_t[]", view) as data:
        address = int(ffi.cast("uintptr_t", data))
    return mapping, view, address


def test_will_need_reads_exactly_the_frames_asked_for(tmp_path):
    """zl_will_need reads the range it is given into the page cache; under MADV_RANDOM
    (as read_file leaves a .zlin mapping) nothing around it is read ahead."""
    mapping, view, address = _uncached_random_mapping(tmp_path / "pages.bin", 16 << 20, 0)
    try:
        before = _resident_pages(address, 16 << 20)
        assert before.sum() <= 16, before.sum()  # dropped (a few may stay)
        lo, hi = (4 << 20) + 100, (6 << 20) - 100  # unaligned ends
        assert lib.zl_will_need(ffi.cast("void *", address + lo), hi - lo) == 0
        for _ in range(200):  # the read is asynchronous
            after = _resident_pages(address, 16 << 20)
            if after[1024:1536].all():
                break
            time.sleep(0.01)
        page = os.sysconf("SC_PAGE_SIZE")
        assert after[(4 << 20) // page : (6 << 20) // page].all()
        assert after[(8 << 20) // page :].sum() <= 16  # nothing read ahead past the range
        assert lib.zl_will_need(ffi.NULL, 0) == 0
    finally:
        view.release()
        mapping.close()


#: Pages MADV_PAGEOUT may skip: those still in another CPU's batch of new pages (a
#: folio_batch of 31), and the page two decode threads' runs share.
SKIPPED_AT_MOST = 32


def _drop_from_page_cache(path, mapping: mmap.mmap) -> None:
    """Take a file's pages out of the page cache, mapped ones too: a page read back
    later comes a page at a time (MADV_RANDOM), as under a memory limit. The large
    folios a sequential read leaves (read_file's check) are not split by MADV_PAGEOUT."""
    mapping.madvise(mmap.MADV_DONTNEED)
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_page_out_drops_the_whole_pages_of_the_range_and_keeps_the_rest(tmp_path):
    """zl_page_out reclaims the pages wholly inside its range (MADV_PAGEOUT, Linux 5.4+)
    and leaves the two pages its ends fall in, and everything outside, in the page
    cache."""
    # Read back a page at a time: the kernel reclaims such pages at once. The large
    # folios write() leaves in the page cache are not split to drop part of one.
    mapping, view, address = _uncached_random_mapping(tmp_path / "pages.bin", 4 << 20, 1)
    try:
        assert int(np.frombuffer(view, np.uint8).sum()) > 0  # every page read, so cached
        page = os.sysconf("SC_PAGE_SIZE")
        n = (4 << 20) // page
        assert _resident_pages(address, 4 << 20).all()
        lo, hi = page * 100 + 7, page * 200 - 7  # pages 100 and 199 are cut
        assert lib.zl_page_out(ffi.cast("void *", address + lo), hi - lo) == 0
        after = _resident_pages(address, 4 << 20)
        # Best effort: a page still in another CPU's batch of newly read pages is not on
        # the LRU lists yet and is skipped.
        assert after[101:199].sum() <= SKIPPED_AT_MOST
        assert after[:101].all() and after[199:n].all()
        assert lib.zl_page_out(ffi.NULL, 0) == 0
        # A range inside one page holds no whole page: nothing to drop.
        assert lib.zl_page_out(ffi.cast("void *", address + 1), page - 2) == 0
        assert _resident_pages(address, page).all()
    finally:
        view.release()
        mapping.close()


def test_decoder_page_out_drops_a_file_weight_and_stops_where_the_platform_refuses(
    tmp_path, monkeypatch
):
    from zstd_linear.fileformat import read_file, write_file

    path = tmp_path / "w.zlin"
    weight = torch.randn(1024, 512)
    write_file(path, [("w", encode_weight(weight), None)])
    encoded = read_file(path)[0][1]
    _drop_from_page_cache(path, encoded.frames[0][0].data.obj)
    decoder = Decoder(threads=2)
    out = torch.empty(encoded.original_bytes, dtype=torch.uint8)
    decoder.decode_into(encoded, out, page_out=True)
    assert torch.equal(view_weight(out, encoded), weight)  # decoded first, then dropped
    table = decoder_module._ChunkTable.of(encoded)
    page = os.sysconf("SC_PAGE_SIZE")
    lo, hi = -(-min(table.lo) // page) * page, max(table.hi) // page * page
    assert hi - lo >= 64 * page
    assert _resident_pages(lo, hi - lo).sum() <= SKIPPED_AT_MOST
    assert decoder.pages_out
    # An anonymous copy of the frames is left alone.
    assert decoder.page_out(encode_weight(weight), range(1))
    # Where the platform has no MADV_PAGEOUT, page_out says so and stops asking.
    calls = []

    def refused(self, chunks):
        calls.append(chunks)
        return lib.ZL_ERR_UNSUPPORTED

    monkeypatch.setattr(decoder_module._ChunkTable, "page_out", refused)
    assert not decoder.page_out(encoded, range(2))
    assert not decoder.pages_out
    decoder.decode_chunks_into(
        encoded, range(1), out[: encoded.span_range(range(1))[1] * 4], page_out=True
    )
    assert calls == [range(2)]  # not asked again
    decoder.close()


def test_decoder_will_need_reads_a_dropped_file_weight_back_without_a_decode(tmp_path):
    """Decoder.will_need starts reading a file weight's frames (posix_madvise WILLNEED):
    its pages come back into the page cache without a fault; a weight in anonymous
    memory, or an empty range, is left alone."""
    import time

    from zstd_linear.fileformat import read_file, write_file

    path = tmp_path / "w.zlin"
    weight = torch.randn(1024, 512)
    write_file(path, [("w", encode_weight(weight), None)])
    encoded = read_file(path)[0][1]
    _drop_from_page_cache(path, encoded.frames[0][0].data.obj)
    table = decoder_module._ChunkTable.of(encoded)
    page = os.sysconf("SC_PAGE_SIZE")
    lo, hi = -(-min(table.lo) // page) * page, max(table.hi) // page * page
    assert hi - lo >= 64 * page
    assert _resident_pages(lo, hi - lo).sum() <= SKIPPED_AT_MOST
    decoder = Decoder(threads=1)
    decoder.will_need(encoded, range(0))
    assert _resident_pages(lo, hi - lo).sum() <= SKIPPED_AT_MOST
    decoder.will_need(encoded)
    deadline = time.monotonic() + 10  # the read is asynchronous
    while not _resident_pages(lo, hi - lo).all() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _resident_pages(lo, hi - lo).all()
    decoder.will_need(encode_weight(weight))  # anonymous frames: nothing to read
    out = torch.empty(encoded.original_bytes, dtype=torch.uint8)
    decoder.decode_into(encoded, out)
    assert torch.equal(view_weight(out, encoded), weight)
    decoder.close()


def test_read_file_leaves_its_mapping_advised_random(tmp_path):
    from zstd_linear.fileformat import read_file, write_file

    path = tmp_path / "w.zlin"
    write_file(path, [("w", encode_weight(torch.randn(256, 256)), None)])
    entries = read_file(path)
    flags = None
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            flags = next(ln for ln in lines[i:] if ln.startswith("VmFlags:")).split()[1:]
            break
    assert flags is not None and "rr" in flags, flags  # rr: MADV_RANDOM
    assert Decoder(1).decode(entries[0][1]).shape == (256, 256)
