"""Keep ExecuTorch from locking a program's pages in memory while it loads.

ExecuTorch's Python runtime maps a ``.pte`` with its ``MmapDataLoader`` and asks the kernel
to lock every segment it maps (``mlock``, errors ignored). A locked page cannot be evicted,
and under a cgroup limit it counts like anonymous memory: SmolLM2's fp32 embedding table
(108 MiB) stays resident even though a token reads one row of it, and while a method loads,
the segment XNNPACK packs its weights from is held in memory beside the packed copy.

Whether the lock takes depends on who runs the process. ``mlock`` needs ``CAP_IPC_LOCK`` or
room under ``RLIMIT_MEMLOCK`` (8 MiB for a user on most Linux systems; containers drop the
capability by default), so an ordinary user's segments larger than the limit are never
locked, while root on a host gets all of them locked. :func:`no_page_locking` makes every
process behave like the ordinary user's, only while a program loads:

- the soft ``RLIMIT_MEMLOCK`` is lowered to 0 (process-wide: another thread that locks
  memory in that window fails as well), and
- on Linux, ``CAP_IPC_LOCK`` is dropped from the calling thread's effective set (it stays
  permitted, and is raised again after).

Both are restored when the block exits, whatever happens inside it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import resource
except ImportError:  # Windows: no memory-lock limit to lower (and no mlock)
    resource = None

CAP_IPC_LOCK = 14
_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.capget, libc.capset
    except (OSError, AttributeError):
        return None


def _capabilities():
    """The calling thread's capability sets (two 32-bit words each), or None where they
    cannot be read."""
    calls = _libc()
    if calls is None:
        return None
    header, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if calls[0](ctypes.byref(header), data) != 0:
        return None
    return data


def _set_capabilities(data) -> bool:
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    return _libc()[1](ctypes.byref(header), data) == 0


def ipc_lock_effective() -> bool | None:
    """Whether the calling thread holds ``CAP_IPC_LOCK`` now (None: not knowable here)."""
    data = _capabilities()
    return None if data is None else bool(data[0].effective >> CAP_IPC_LOCK & 1)


@contextmanager
def no_page_locking() -> Iterator[None]:
    """Inside the block, the kernel refuses this process's page locks (see the module
    docstring); the memory-lock limit and the thread's capabilities are restored after."""
    if resource is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, hard))
    data = _capabilities()
    dropped = False
    try:
        if data is not None and data[0].effective >> CAP_IPC_LOCK & 1:
            lowered = (_CapData * 2)()
            ctypes.memmove(lowered, data, ctypes.sizeof(lowered))
            lowered[0].effective &= ~(1 << CAP_IPC_LOCK)
            dropped = _set_capabilities(lowered)
        yield
    finally:
        try:
            if dropped and not _set_capabilities(data):
                raise OSError(
                    ctypes.get_errno(), "could not raise CAP_IPC_LOCK again after loading"
                )
        finally:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
