"""The cffi description of the C core (API, out-of-line mode).

Used by ``hatch_build.py`` to compile the extension ``_paired_cache_core`` and by the tests
to inspect the generated glue. Needs cffi (and setuptools to compile), nothing else.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC = Path(__file__).resolve().parent
MODULE_NAME = "_paired_cache_core"
SOURCES = ["pc_cache.c", "pc_update.c", "pc_parallel.c", "pc_rows.c", "pc_select.c"]
HEADERS = ["paired_cache.h", "pc_internal.h"]
# -O3 for the copy loops; no -march: a wheel must run on any x86-64 / aarch64 machine.
# -fno-trapping-math: nothing reads the floating-point exception flags, and without it GCC
# keeps the selects of pc_select.c's scoring loop as branches and does not vectorise it
# (values are unchanged: it is not -ffast-math).
# -ffp-contract=off: a product then a sum stay two roundings (no fused multiply-add where
# the target has one, aarch64), as torch computes them: the grid decode gives the weights
# grid_pool.dequantize gives, bit for bit.
COMPILE_ARGS = [
    "-std=c11",
    "-O3",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-pthread",
    "-Wall",
    "-Wextra",
]


def source_digest() -> str:
    """sha256 over the C sources and headers, compiled into the core as PC_SOURCE_DIGEST."""
    digest = hashlib.sha256()
    for name in sorted(SOURCES + HEADERS):
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()


def cdef_text() -> str:
    """The declarations between the cdef markers of paired_cache.h."""
    header = (CSRC / "paired_cache.h").read_text()
    start = header.index("/* cdef-begin */") + len("/* cdef-begin */")
    return header[start : header.index("/* cdef-end */")]


def make_ffibuilder():
    import cffi

    ffibuilder = cffi.FFI()
    ffibuilder.cdef(cdef_text())
    ffibuilder.set_source(
        MODULE_NAME,
        '#include "paired_cache.h"',
        sources=[str(CSRC / name) for name in SOURCES],
        include_dirs=[str(CSRC)],
        define_macros=[("PC_SOURCE_DIGEST", f'"{source_digest()}"')],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-pthread"],
        libraries=["m"],
    )
    return ffibuilder
