"""The compiled C core: the cffi ``ffi`` and ``lib`` of ``_zstd_linear_core``.

The build hook (hatch_build.py) compiles it into every wheel and editable install; there
is no pure-Python fallback, so a missing core is an installation error, said plainly.
"""

from __future__ import annotations

import numpy as np

from zstd_linear.errors import ZstdLinearError

try:
    from _zstd_linear_core import ffi, lib
except ImportError as exc:  # pragma: no cover - only a broken installation gets here
    raise ImportError(
        "zstd_linear's compiled C core (_zstd_linear_core) is missing; reinstall the "
        "package (`pip install packages/zstd-linear`, or `hatch env remove zstd-linear && "
        "hatch env create zstd-linear`) so that its build hook compiles it"
    ) from exc


_ERRORS = {
    lib.ZL_ERR_WIDTH: "width must be 2 or 4",
    lib.ZL_ERR_ROTATION: "rotation must be in 0..8*width-1",
    lib.ZL_ERR_NULL: "a plane or the output is NULL",
    lib.ZL_ERR_SIZE: "the packed bytes do not match the plane's size",
    lib.ZL_ERR_DATA: "the packed plane's mask or constant bits are invalid",
}


def join_planes(planes: list, out: np.ndarray, rotation: int) -> None:
    """Join byte planes into ``out`` in C (the GIL is released during the join).

    planes: 2 or 4 buffers of E bytes each (numpy arrays, bytes or memoryviews, read-only
    is fine); out: (E * len(planes),) uint8, writable and contiguous. Element i of out is
    ``rotr(planes[0][i] | planes[1][i] << 8 | ..., rotation)``, little-endian: the inverse
    of ``Layout.split``, which the numpy ``Layout.join`` computes too.
    """
    width = len(planes)
    if width not in (2, 4):
        raise ZstdLinearError(f"planes must hold 2 or 4 planes, got {width}")
    n = out.size // width
    if out.dtype != np.uint8 or out.ndim != 1 or n * width != out.size:
        raise ZstdLinearError(
            f"out must be a 1-D uint8 array of E * {width} bytes, got {out.shape} {out.dtype}"
        )
    pointers = [ffi.from_buffer("uint8_t[]", plane) for plane in planes]
    for p, pointer in enumerate(pointers):
        if len(pointer) != n:
            raise ZstdLinearError(f"plane {p} holds {len(pointer)} bytes, expected {n}")
    if width == 2:
        pointers += [ffi.NULL, ffi.NULL]
    target = ffi.from_buffer("uint8_t[]", out, require_writable=True)
    status = lib.zl_join(width, rotation, n, *pointers, target)
    if status != lib.ZL_OK:
        raise ZstdLinearError(f"zl_join: {_ERRORS.get(status, status)}")


def bitpack_size(n: int, mask: int) -> int:
    """Stored bytes of a bit-packed plane of ``n`` bytes whose constant bits are ``mask``."""
    return int(lib.zl_bitpack_size(n, mask))


def check_bitpack(src, n: int) -> None:
    """ZstdLinearError unless ``src`` (bytes-like) is a valid bit-packing of ``n`` bytes:
    the same check ``unpack_bits`` makes before it writes anything."""
    source = ffi.from_buffer("uint8_t[]", src)
    status = lib.zl_unpack_bits(n, source, len(source), ffi.NULL)  # NULL out: check only
    if status != lib.ZL_OK:
        raise ZstdLinearError(f"zl_unpack_bits: {_ERRORS.get(status, status)}")


def unpack_bits(src, out: np.ndarray) -> None:
    """Unpack the bit-packed plane ``src`` (bytes-like: mask, value, codes) into ``out``
    ((n,) uint8, writable, contiguous) in C, with the GIL released. ZstdLinearError,
    with nothing written, when ``src`` is not a valid packing of ``out.size`` bytes."""
    if out.dtype != np.uint8 or out.ndim != 1:
        raise ZstdLinearError(f"out must be a 1-D uint8 array, got {out.shape} {out.dtype}")
    source = ffi.from_buffer("uint8_t[]", src)
    target = ffi.from_buffer("uint8_t[]", out, require_writable=True)
    status = lib.zl_unpack_bits(out.size, source, len(source), target)
    if status != lib.ZL_OK:
        raise ZstdLinearError(f"zl_unpack_bits: {_ERRORS.get(status, status)}")


def core_info() -> str:
    """The C core's build stamp: C standard and sha256 of the compiled sources."""
    return ffi.string(lib.zl_core_info()).decode()


__all__ = [
    "bitpack_size",
    "check_bitpack",
    "core_info",
    "ffi",
    "join_planes",
    "lib",
    "unpack_bits",
]
