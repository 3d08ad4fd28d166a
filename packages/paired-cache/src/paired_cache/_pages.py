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


UNLIMITED = 1 << 62  # a cgroup v1 limit at or above this means none (the kernel writes ~2**63)


def _cgroup_mounts(mountinfo: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(cgroup v1 memory mounts, cgroup v2 mounts), each as (root in the hierarchy, mount
    point), from the text of /proc/self/mountinfo.

    The same reading as zstd-linear's ``sysmem._mounts``: the packages install separately
    and share no runtime dependency, so each carries its own copy."""
    v1, v2 = [], []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if not after:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if after[0] == "cgroup2":
            v2.append((root, point))
        elif after[0] == "cgroup" and "memory" in (after[-1].split(",") if len(after) > 2 else []):
            v1.append((root, point))
    return v1, v2


def _groups_up(point: str, root: str, path: str) -> list[Path]:
    """The directories of the group at hierarchy ``path`` and of every group above it that
    the mount (of hierarchy ``root`` at ``point``) shows, nearest first."""
    rel = path
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        rel = path[len(root) :]
    elif root != "/":
        rel = "/"  # a namespaced mount shows our group as its root
    parts = [p for p in rel.split("/") if p]
    return [Path(point, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def memory_groups(proc: str | os.PathLike = "/proc/self") -> list[Path]:
    """This process's memory cgroup directories, its own group first, then every group
    above it that is mounted (cgroup v1's memory controller and v2, found through
    mountinfo, so a namespaced or non-standard mount is read where it is). Empty where
    cgroups are not mounted."""
    proc = Path(proc)
    try:
        groups = (proc / "cgroup").read_text()
        v1_mounts, v2_mounts = _cgroup_mounts((proc / "mountinfo").read_text())
    except OSError:
        return []
    found: list[Path] = []
    for line in groups.splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":
            mounts, file = v2_mounts, "memory.max"
        elif "memory" in controllers.split(","):
            mounts, file = v1_mounts, "memory.limit_in_bytes"
        else:
            continue
        for root, point in mounts:
            found += [d for d in _groups_up(point, root, path) if (d / file).exists()]
    return found


def _read_stat(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def page_cache_room(groups=None) -> int | None:
    """Bytes of page cache this process's memory cgroups leave room for: for every group
    with a hard limit (cgroup v1 ``memory.limit_in_bytes`` or v2 ``memory.max``), the limit
    minus what the group holds besides file pages (anonymous memory, kernel memory); the
    smallest of these. None where no limit applies or one cannot be read.

    groups: the group directories to read (:func:`memory_groups`' list, looked up once by
    a caller that asks every token), or one directory and the groups above it whose
    limit file exists (for tests); default, this process's."""
    if groups is None:
        groups = memory_groups()
    elif isinstance(groups, str | os.PathLike):
        groups = _with_ancestors(Path(groups))
    rooms = []
    for node in groups:
        v2 = (node / "memory.max").exists()
        try:
            raw = (node / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
            if raw == "max" or int(raw) >= UNLIMITED:
                continue
            stat = _read_stat(node / "memory.stat")
            if v2:
                usage = int((node / "memory.current").read_text())
                file_bytes = stat.get("file", 0)
            else:
                usage = int((node / "memory.usage_in_bytes").read_text())
                file_bytes = stat.get("total_cache", stat.get("cache", 0))
        except (OSError, ValueError):
            return None
        rooms.append(int(raw) - (usage - file_bytes))
    return min(rooms) if rooms else None


def _with_ancestors(group: Path) -> list[Path]:
    limit_file = "memory.max" if (group / "memory.max").exists() else "memory.limit_in_bytes"
    out = [group]
    while out[-1].parent != out[-1] and (out[-1].parent / limit_file).exists():
        out.append(out[-1].parent)
    return out
