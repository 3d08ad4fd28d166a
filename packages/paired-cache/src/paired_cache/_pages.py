"""Page-cache helpers shared by the read-only file mappings (safetensors, pool files)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

# MADV_PAGEOUT (Linux >= 5.4): reclaim the range's pages now. Python's mmap module does not
# name it; madvise takes the number.
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21 if sys.platform.startswith("linux") else None)


def _libc_mincore():
    """libc's mincore(2), or None where libc has none (is_cached then says False)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_mincore = _libc_mincore()


class MappedPages:
    """is_cached and will_need_range over ``self._mmap``, a read-only mmap of a file."""

    _mmap: mmap.mmap
    _address: int | None = None

    def _base(self) -> int:
        if self._address is None:
            # Read-only mappings refuse ctypes' from_buffer; numpy takes their address.
            import numpy as np

            self._array = np.frombuffer(self._mmap, np.uint8)
            self._address = self._array.ctypes.data
            self._vec = (ctypes.c_ubyte * 1)()  # one page's mincore byte
        return self._address

    def is_cached(self, begin: int, end: int, *, sample: bool = False) -> bool:
        """Whether the file's bytes [begin, end) are in the page cache (``mincore``): every
        page, or with sample=True its first, middle and last pages only (a range read in
        order is evicted oldest page first, so a missing first page shows eviction). False
        where mincore is unavailable. Far cheaper than asking for cached pages with
        ``will_need_range``, which walks them in the kernel."""
        if _mincore is None:
            return False
        if end <= begin:
            return True
        page, base = mmap.PAGESIZE, self._base()
        if sample:
            vec = self._vec
            for at in (begin, (begin + end - 1) // 2, end - 1):
                if _mincore(base + at - at % page, page, vec) != 0 or not vec[0] & 1:
                    return False
            return True
        start = begin - begin % page
        vec = (ctypes.c_ubyte * -(-(end - start) // page))()
        if _mincore(base + start, end - start, vec) != 0:
            return False
        return all(b & 1 for b in bytes(vec))

    def will_need_range(self, begin: int, end: int) -> None:
        """``MADV_WILLNEED`` over the file's bytes [begin, end): one asynchronous read."""
        if not hasattr(mmap, "MADV_WILLNEED"):
            return
        start = begin - begin % mmap.PAGESIZE  # madvise takes a page-aligned start
        if end > start:
            self._mmap.madvise(mmap.MADV_WILLNEED, start, end - start)

    def page_out_range(self, begin: int, end: int) -> bool:
        """``MADV_PAGEOUT`` over the whole pages inside the file's bytes [begin, end): the
        kernel drops them from the page cache now (clean file pages: nothing is written),
        instead of evicting, later, pages that will be read again sooner. A page shared
        with bytes outside the range is left alone. False where the kernel refuses
        (before Linux 5.4) or the platform has no such advice."""
        if MADV_PAGEOUT is None:
            return False
        page, size = mmap.PAGESIZE, len(self._mmap)
        start = -(-begin // page) * page
        # The file's last page is partial: a range that ends with the file takes it.
        stop = size if end >= size else end // page * page
        if stop <= start:
            return True
        try:
            self._mmap.madvise(MADV_PAGEOUT, start, stop - start)
        except OSError:
            return False
        return True


def _memory_group() -> Path | None:
    """This process's memory cgroup directory (v1 memory controller, else v2), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return group if (group / "memory.limit_in_bytes").exists() else None
    for line in lines:
        if line.startswith("0::"):
            group = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            return group if (group / "memory.max").exists() else None
    return None


def _read_stat(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def page_cache_room(group: str | os.PathLike | None = None) -> int | None:
    """Bytes of page cache this process's memory cgroup leaves room for: the nearest hard
    limit (the group's or an ancestor's; cgroup v1 ``memory.limit_in_bytes`` or v2
    ``memory.max``) minus what that group holds besides file pages (anonymous memory,
    kernel memory). None where no limit applies or it cannot be read. group: the group's
    directory (for tests); default, this process's."""
    start = Path(group) if group is not None else _memory_group()
    node = start
    while node is not None:
        v2 = (node / "memory.max").exists()
        try:
            raw = (node / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
        except OSError:
            return None
        if raw != "max" and int(raw) < 2**62:
            try:
                stat = _read_stat(node / "memory.stat")
                if v2:
                    usage = int((node / "memory.current").read_text())
                    file_bytes = stat.get("file", 0)
                else:
                    usage = int((node / "memory.usage_in_bytes").read_text())
                    file_bytes = stat.get("total_cache", stat.get("cache", 0))
            except (OSError, ValueError):
                return None
            return int(raw) - (usage - file_bytes)
        parent = node.parent
        limit_file = "memory.max" if v2 else "memory.limit_in_bytes"
        node = parent if parent != node and (parent / limit_file).exists() else None
    return None
