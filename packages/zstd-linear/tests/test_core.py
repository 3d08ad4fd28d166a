"""The C plane join equals the numpy reference join and the original bits; the C unpack
of a bit-packed plane equals a numpy reference and the plane; the compiled core is what
runs, it is current, its calls release the GIL, and the wheel is a
platform-tagged binary whose build fails when the C does not compile."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zstd_linear._core import bitpack_size, core_info, ffi, join_planes, lib, unpack_bits
from zstd_linear.codec import bitpack
from zstd_linear.errors import ZstdLinearError
from zstd_linear.layout import LAYOUTS, SUPPORTED_DTYPES

PACKAGE = Path(__file__).resolve().parents[1]
PLANE_LAYOUTS = sorted(name for name, layout in LAYOUTS.items() if layout.planes)
SPECIAL = {
    "float32": [0x7FC00000, 0xFFC00001, 0x7F800000, 0xFF800000, 0x1, 0x807FFFFF, 0x80000000, 0],
    "bfloat16": [0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x8000, 0],
    "float16": [0x7E00, 0xFE01, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x8000, 0],
}  # quiet/payload NaN, +inf, -inf, smallest and largest subnormal, -0.0, +0.0


@st.composite
def bit_patterns(draw):
    """(dtype name, (E,) unsigned bit patterns): random bits, normal values, specials."""
    dtype = draw(st.sampled_from(sorted(SUPPORTED_DTYPES)))
    int_dtype = SUPPORTED_DTYPES[dtype][1]
    n = draw(st.integers(0, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["random_bits", "normal", "special_mix", "special_only"]))
    if kind == "random_bits":
        bits = rng.integers(0, 2 ** (8 * int_dtype.itemsize), n, dtype=np.uint64).astype(int_dtype)
    elif kind == "special_only":
        bits = rng.choice(np.array(SPECIAL[dtype], dtype=int_dtype), n)
    else:
        torch_dtype = SUPPORTED_DTYPES[dtype][0]
        import torch

        values = torch.from_numpy(rng.normal(0, 0.02, n)).to(torch_dtype)
        bits = (
            values.view(torch.uint8).numpy().view(int_dtype).copy() if n else np.empty(0, int_dtype)
        )
        if kind == "special_mix" and n:
            idx = rng.integers(0, n, max(1, n // 4))
            bits[idx] = rng.choice(np.array(SPECIAL[dtype], dtype=int_dtype), idx.size)
    return dtype, bits.astype(int_dtype)


@settings(max_examples=300, deadline=None)
@given(
    case=bit_patterns(),
    layout=st.sampled_from(PLANE_LAYOUTS),
    offset=st.integers(0, 7),
    as_bytes=st.booleans(),
)
def test_c_join_equals_numpy_join_equals_original_bits(case, layout, offset, as_bytes):
    dtype, bits = case
    lay = LAYOUTS[layout]
    planes = lay.split(bits, dtype)  # n contiguous (E,) uint8
    reference = np.empty(bits.nbytes, np.uint8)
    lay.join(planes, reference, np.empty(bits.size, bits.dtype), dtype)
    # An output at any byte offset (a chunk_into target need not be aligned), planes given
    # as read-only bytes (raw frames from a file) or as numpy scratch.
    backing = np.full(bits.nbytes + offset + 8, 0xAB, np.uint8)
    out = backing[offset : offset + bits.nbytes]
    sources = [p.tobytes() for p in planes] if as_bytes else planes
    join_planes(sources, out, lay.rotation[dtype])
    assert np.array_equal(reference.view(bits.dtype), bits)
    assert np.array_equal(out, reference)
    assert (backing[:offset] == 0xAB).all() and (backing[offset + bits.nbytes :] == 0xAB).all()


@pytest.mark.parametrize("width, int_dtype", [(2, np.uint16), (4, np.uint32)])
def test_c_join_every_rotation(width, int_dtype):
    rng = np.random.default_rng(width)
    bits = rng.integers(0, 2 ** (8 * width), 1001, dtype=np.uint64).astype(int_dtype)
    planes = [
        np.ascontiguousarray(bits.view(np.uint8).reshape(-1, width)[:, p]) for p in range(width)
    ]
    for k in range(8 * width):
        out = np.empty(bits.nbytes, np.uint8)
        join_planes(planes, out, k)
        rotr = (bits >> int_dtype(k)) | (bits << int_dtype((8 * width - k) % (8 * width)))
        assert np.array_equal(out.view(int_dtype), rotr.astype(int_dtype)), k


def test_join_rejects_bad_input_before_writing():
    planes = [np.zeros(10, np.uint8), np.zeros(10, np.uint8)]
    out = np.full(20, 7, np.uint8)
    with pytest.raises(ZstdLinearError, match="2 or 4 planes"):
        join_planes(planes[:1], out[:10], 0)
    with pytest.raises(ZstdLinearError, match="plane 1 holds 9 bytes"):
        join_planes([planes[0], planes[1][:9]], out, 0)
    with pytest.raises(ZstdLinearError, match="uint8"):
        join_planes(planes, out.view(np.uint16), 0)
    with pytest.raises(ZstdLinearError, match="rotation"):
        join_planes(planes, out, 16)
    with pytest.raises(ZstdLinearError, match="rotation"):
        join_planes(planes, out, -1)
    out.flags.writeable = False
    with pytest.raises((TypeError, ValueError)):
        join_planes(planes, out, 0)
    assert (out == 7).all()


def _unpack_reference(packed: bytes, n: int) -> np.ndarray:
    """numpy's reading of the packing codec.bitpack documents, bit by bit."""
    mask, value = packed[0], packed[1]
    free = [b for b in range(8) if not mask >> b & 1]
    bits = np.unpackbits(np.frombuffer(packed[2:], np.uint8), bitorder="little")
    codes = bits[: n * len(free)].reshape(n, len(free))
    out = np.full(n, value, np.uint8)
    for i, b in enumerate(free):
        out |= codes[:, i] << b
    return out


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(0, 200) | st.integers(200, 70000),
    mask=st.integers(0, 255),
    seed=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 7),
)
def test_c_unpack_equals_numpy_reference_equals_the_plane(n, mask, seed, offset):
    rng = np.random.default_rng(seed)
    plane = rng.integers(0, 256, n, dtype=np.uint8)
    plane = (plane & ~np.uint8(mask)) | (np.uint8(rng.integers(0, 256)) & np.uint8(mask))
    packed = bitpack(plane)
    varying = int(np.bitwise_and.reduce(plane) ^ np.bitwise_or.reduce(plane)) if n else 0xFF
    if varying == 0xFF:  # every bit varies somewhere (or nothing to pack)
        assert packed is None
        return
    varying = varying or 0x80  # a constant plane keeps bit 7: at most 8x expansion
    k = bin(varying).count("1")
    assert packed[0] == 0xFF & ~varying and packed[1] == plane[0] & packed[0]
    assert len(packed) == bitpack_size(n, packed[0]) == 2 + -(-n * k // 8)
    assert np.array_equal(_unpack_reference(packed, n), plane)
    out = np.zeros(n + offset, np.uint8)[offset:]  # any alignment
    unpack_bits(packed, out)
    assert np.array_equal(out, plane)
    # from a read-only, unaligned view of a larger buffer (a frame in the file's mapping)
    backing = bytes(offset) + packed + bytes(3)
    view = memoryview(backing)[offset : offset + len(packed)]
    out2 = np.empty(n, np.uint8)
    unpack_bits(view, out2)
    assert np.array_equal(out2, plane)


def test_unpack_rejects_bad_input_before_writing():
    plane = np.arange(100, dtype=np.uint8) & 0x7F
    packed = bitpack(plane)
    assert packed[0] == 0x80 and len(packed) == 2 + 88
    out = np.full(100, 7, np.uint8)
    with pytest.raises(ZstdLinearError, match="do not match the plane's size"):
        unpack_bits(packed[:-1], out)
    with pytest.raises(ZstdLinearError, match="do not match the plane's size"):
        unpack_bits(packed + b"\0", out)
    with pytest.raises(ZstdLinearError, match="do not match the plane's size"):
        unpack_bits(packed, out[:99])
    with pytest.raises(ZstdLinearError, match="do not match the plane's size"):
        unpack_bits(packed[:1], out)
    with pytest.raises(ZstdLinearError, match="mask or constant bits"):
        unpack_bits(b"\0\0" + packed[2:], out)  # mask 0: nothing constant
    with pytest.raises(ZstdLinearError, match="mask or constant bits"):
        unpack_bits(b"\xff\0", out)  # mask 0xFF: 0 bits a byte, unbounded expansion
    with pytest.raises(ZstdLinearError, match="mask or constant bits"):
        unpack_bits(b"\x80\x01" + packed[2:], out)  # a constant outside the mask
    with pytest.raises(ZstdLinearError, match="uint8"):
        unpack_bits(packed, out.view(np.uint16))
    assert (out == 7).all()
    out.flags.writeable = False
    with pytest.raises((TypeError, ValueError)):
        unpack_bits(packed, out)
    # a constant plane keeps bit 7: 1 bit a byte
    constant = np.full(1000, 0x5A, np.uint8)
    packed = bitpack(constant)
    assert packed[:2] == b"\x7f\x5a" and len(packed) == 2 + 125
    out = np.empty(1000, np.uint8)
    unpack_bits(packed, out)
    assert (out == 0x5A).all()


def _ffi_build():
    spec = importlib.util.spec_from_file_location("ffi_build", PACKAGE / "csrc" / "ffi_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_core_is_a_compiled_extension():
    import _zstd_linear_core

    path = Path(_zstd_linear_core.__file__)
    assert path.suffix == ".so"
    assert path.read_bytes()[:4] == b"\x7fELF"
    # API mode: lib's functions are builtins of the extension, not ctypes/ABI trampolines.
    assert type(lib.zl_join).__name__ == "builtin_function_or_method"
    assert ffi.sizeof("size_t") == 8


def test_core_was_built_from_the_current_sources():
    info = core_info()
    assert _ffi_build().source_digest() in info, (
        f"the installed C core ({info}) is stale: rebuild it with "
        "`hatch env remove zstd-linear && hatch env create zstd-linear`"
    )
    assert "C201112L" in info


def test_every_c_call_releases_the_gil(tmp_path):
    builder = _ffi_build().make_ffibuilder()
    glue = tmp_path / "glue.c"
    builder.emit_c_code(str(glue))
    text = glue.read_text()
    names = re.findall(r"^\w[\w\s\*]*\b(zl_\w+)\(", _ffi_build().cdef_text(), re.M)
    assert sorted(names) == [
        "zl_bitpack_size",
        "zl_core_info",
        "zl_decode_chunks",
        "zl_join",
        "zl_page_out",
        "zl_unpack_bits",
        "zl_will_need",
    ]
    for name in names:
        body = text[text.index(f"_cffi_f_{name}(") :]
        body = body[: body.index("\n}\n")]
        call = body.index(f"{name}(", body.index("Py_BEGIN_ALLOW_THREADS"))
        assert body.index("Py_BEGIN_ALLOW_THREADS") < call < body.index("Py_END_ALLOW_THREADS")


def _build_wheel(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory):
    dst = tmp_path_factory.mktemp("pkg") / "zstd-linear"
    shutil.copytree(PACKAGE, dst, ignore=shutil.ignore_patterns("results", "__pycache__"))
    return dst


def test_wheel_is_platform_tagged_and_holds_the_core(package_copy, tmp_path):
    result = _build_wheel(package_copy, tmp_path)
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert re.search(r"-cp3\d+-cp3\d+-linux_\w+\.whl$", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert any(re.fullmatch(r"_zstd_linear_core\..*\.so", n) for n in names), names
        assert "zstd_linear/py.typed" in names, names
        wheel_meta = next(n for n in names if n.endswith(".dist-info/WHEEL"))
        assert "Root-Is-Purelib: false" in zf.read(wheel_meta).decode()


def test_a_failed_compile_fails_the_build(package_copy, tmp_path):
    broken = package_copy.parent / "broken"
    shutil.copytree(package_copy, broken)
    join_c = broken / "csrc" / "zl_join.c"
    join_c.write_text(join_c.read_text() + "\nthis is not C;\n")
    result = _build_wheel(broken, tmp_path)
    assert result.returncode != 0
    assert not list(tmp_path.glob("*.whl"))
