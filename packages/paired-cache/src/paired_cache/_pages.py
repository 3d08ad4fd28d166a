"""Page-cache helpers shared by the read-only file mappings (safetensors, pool files)."""

from __future__ import annotations

import ctypes
import mmap


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
