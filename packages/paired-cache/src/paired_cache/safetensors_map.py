"""A .safetensors file mapped read-only: each tensor a zero-copy view of its bytes, so a
model's weights stay file-backed page cache (what load_sparse and the predictor files read)."""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path

import torch

from paired_cache._pages import MappedPages
from paired_cache.errors import PairedCacheError

ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
}


class SafetensorsMap(MappedPages):
    """A .safetensors file mapped read-only: tensor(name) is a zero-copy view of its bytes.

    random_access: advise the mapping ``MADV_RANDOM``, so that a page fault reads its page
    only and not the device's read-ahead around it (8 MiB on this machine's disk, which
    drags in the tensors stored next to the one asked for, e.g. the up and down
    projections a pool file replaces); ask for what is read in full with ``will_need``.
    """

    def __init__(self, path: str | os.PathLike, *, random_access: bool = False) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise PairedCacheError(f"{self.path}: too short for safetensors")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise PairedCacheError(f"{self.path}: header length {n} past the file's end")
            try:
                meta = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise PairedCacheError(f"{self.path}: header is not JSON ({exc})") from None
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if random_access and hasattr(mmap, "MADV_RANDOM"):
            self._mmap.madvise(mmap.MADV_RANDOM)
        if not isinstance(meta, dict):
            raise PairedCacheError(f"{self.path}: header is not a JSON object")
        meta.pop("__metadata__", None)
        self._start, self._size = 8 + n, size
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in meta.items():
            try:
                dtype = ST_DTYPES[entry["dtype"]]
                shape = tuple(int(s) for s in entry["shape"])
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise PairedCacheError(
                    f"{self.path}: bad entry for {name}: {entry!r:.120}"
                ) from None
            count = 1
            for s in shape:
                count *= s
            if (
                any(s < 0 for s in shape)
                or end - begin != count * dtype.itemsize
                or begin < 0
                or self._start + end > size
            ):
                raise PairedCacheError(f"{self.path}: {name} {shape} does not fit its bytes")
            self.entries[name] = (dtype, shape, self._start + begin, self._start + end)

    def ranges(self, names) -> list[tuple[int, int]]:
        """The byte ranges of tensors ``names`` in the file, in file order, tensors less than
        a page apart merged into one range (so merging reads no other tensor's pages)."""
        spans = sorted(self.entries[n][2:] for n in names)
        out: list[list[int]] = []
        for begin, end in spans:
            if out and begin - out[-1][1] < mmap.PAGESIZE:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([begin, end])
        return [(b, e) for b, e in out if e > b]

    def will_need(self, name: str) -> None:
        """Have the kernel read tensor ``name``'s bytes now, in one asynchronous request
        over exactly its range (``MADV_WILLNEED``); pages already cached cost a lookup."""
        _, _, begin, end = self.entries[name]
        self.will_need_range(begin, end)

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor as a read-only view of its mapped bytes (writing to it faults).

        Args:
            name: a key of ``entries``.

        Returns:
            The tensor, of its stored dtype and shape.
        """
        dtype, shape, begin, end = self.entries[name]
        if begin % dtype.itemsize:
            raise PairedCacheError(f"{self.path}: {name} is not aligned to its element size")
        with warnings.catch_warnings():
            # Read-only on purpose: a write faults instead of copying the page.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(memoryview(self._mmap)[begin:end], dtype=torch.uint8)
        return flat.view(dtype).view(shape)


__all__ = ["ST_DTYPES", "SafetensorsMap"]
