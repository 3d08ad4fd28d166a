"""The compiled C core: the cffi ``ffi`` and ``lib`` of ``_paired_cache_core``.

The build hook (hatch_build.py) compiles it into every wheel and editable install; there
is no pure-Python fallback, so a missing core is an installation error, said plainly.
"""

from __future__ import annotations

from paired_cache.errors import PairedCacheError

try:
    from _paired_cache_core import ffi, lib
except ImportError as exc:  # pragma: no cover - only a broken installation gets here
    raise ImportError(
        "paired_cache's compiled C core (_paired_cache_core) is missing; reinstall the "
        "package (`pip install packages/paired-cache`, or `hatch env remove paired-cache && "
        "hatch env create paired-cache`) so that its build hook compiles it"
    ) from exc

ERROR_NAMES = {
    lib.PC_ERR_CONFIG: "invalid configuration",
    lib.PC_ERR_NOMEM: "out of memory",
    lib.PC_ERR_CAPACITY: "more rows than capacity",
    lib.PC_ERR_INVALID: "invariant broken",
}


def check_kernel_rc(fn: str, rc: int, n_rows: int) -> None:
    """PairedCacheError for a row kernel's return code other than PC_OK."""
    if rc != lib.PC_OK:
        raise PairedCacheError(
            f"{fn}: a row id in idx is outside [0, {n_rows})"
            if rc == lib.PC_ERR_INVALID
            else f"{fn} refused by the core ({ERROR_NAMES.get(rc, rc)})"
        )


def core_info() -> str:
    """The C core's build stamp: C standard, threading, sha256 of the compiled sources."""
    return ffi.string(lib.pc_core_info()).decode()


__all__ = ["ERROR_NAMES", "check_kernel_rc", "core_info", "ffi", "lib"]
