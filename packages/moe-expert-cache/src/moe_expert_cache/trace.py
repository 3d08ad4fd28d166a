"""Router traces: which experts each MoE layer chose for each token, saved to a file.

File format (version 2): the 8 bytes ``MOETRACE``, a little-endian uint32 header length,
a UTF-8 JSON header ``{"version", "num_layers", "num_experts", "top_k", "records"}``, then
``records`` rows of int32 ``(layer, token, expert_1 .. expert_k)``, then the 32-byte
SHA-256 of everything before it (magic and header included), verified before anything is
parsed. Sizes are checked before anything is allocated, and every row's layer and expert
ids against the header.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

from moe_expert_cache.checked_json import is_int, loads_strict, write_atomic
from moe_expert_cache.errors import ExpertCacheError

MAGIC = b"MOETRACE"
VERSION = 2
HEADER_KEYS = ("num_experts", "num_layers", "records", "top_k", "version")
# Bounds far above any real model, so a damaged header cannot ask for absurd tables.
MAX_LAYERS, MAX_EXPERTS, MAX_TOP_K = 4096, 2**20, 1024


class RouterTrace:
    """Records ``(layer, token, expert ids)``; ``rows()`` is int32 (records, 2 + top_k)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        sizes = (num_layers, num_experts, top_k)
        if (
            not all(is_int(v) or isinstance(v, np.integer) for v in sizes)
            or not 1 <= num_layers <= MAX_LAYERS
            or not 1 <= top_k <= min(num_experts, MAX_TOP_K)
            or num_experts > MAX_EXPERTS
        ):
            raise ExpertCacheError(
                f"need integers 1 <= num_layers <= {MAX_LAYERS} and 1 <= top_k <= "
                f"min(num_experts, {MAX_TOP_K}), num_experts <= {MAX_EXPERTS}; got "
                f"num_layers={num_layers!r}, num_experts={num_experts!r}, top_k={top_k!r}"
            )
        num_layers, num_experts, top_k = int(num_layers), int(num_experts), int(top_k)
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self._rows: list[np.ndarray] = []

    def append(self, layer: int, token: int, experts) -> None:
        experts = np.asarray(experts, dtype=np.int32).ravel()
        if experts.size != self.top_k or not 0 <= layer < self.num_layers or token < 0:
            raise ExpertCacheError(
                f"record ({layer}, {token}, {experts}) does not fit this trace: expected layer "
                f"in [0, {self.num_layers}), token >= 0 and {self.top_k} experts"
            )
        if experts.min() < 0 or experts.max() >= self.num_experts:
            raise ExpertCacheError(f"expert ids {experts} outside [0, {self.num_experts})")
        if len(set(experts.tolist())) != self.top_k:
            raise ExpertCacheError(f"expert ids {experts} repeat an expert")
        self._rows.append(np.concatenate([np.array([layer, token], dtype=np.int32), experts]))

    def rows(self) -> np.ndarray:
        if not self._rows:
            return np.zeros((0, 2 + self.top_k), dtype=np.int32)
        return np.stack(self._rows)

    def layer_requests(self, layer: int) -> np.ndarray:
        """The expert ids of ``layer`` in token order: int32 (tokens, top_k)."""
        rows = self.rows()
        rows = rows[rows[:, 0] == layer]
        return rows[np.argsort(rows[:, 1], kind="stable"), 2:]

    @classmethod
    def from_requests(cls, requests: list[np.ndarray], num_experts: int) -> RouterTrace:
        """A trace from per-layer (tokens, top_k) expert ids (e.g. a synthetic workload)."""
        trace = cls(len(requests), num_experts, requests[0].shape[1])
        for layer, req in enumerate(requests):
            for token, row in enumerate(req):
                trace.append(layer, token, row)
        return trace

    def save(self, path: str | Path) -> None:
        payload = np.ascontiguousarray(self.rows(), dtype="<i4").tobytes()
        header = json.dumps(
            {
                "version": VERSION,
                "num_layers": self.num_layers,
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "records": len(self._rows),
            }
        ).encode()
        body = MAGIC + struct.pack("<I", len(header)) + header + payload
        write_atomic(path, body + hashlib.sha256(body).digest())

    @classmethod
    def load(cls, path: str | Path) -> RouterTrace:
        path = Path(path)
        data = path.read_bytes()
        if data[:8] != MAGIC or len(data) < 12 + 32:
            raise ExpertCacheError(f"{path} is not a router trace (bad magic or too short)")
        body = data[:-32]
        if hashlib.sha256(body).digest() != data[-32:]:
            raise ExpertCacheError(
                f"{path}: SHA-256 checksum mismatch (the trace was changed or damaged, or it was "
                f"written by moe-expert-cache < 0.2.0: record it again)"
            )
        (n,) = struct.unpack("<I", body[8:12])
        if 12 + n > len(body):
            raise ExpertCacheError(f"{path}: header length {n} runs past the end of the file")
        header = loads_strict(body[12 : 12 + n], f"{path}: header")
        if not isinstance(header, dict) or sorted(header) != sorted(HEADER_KEYS):
            raise ExpertCacheError(f"{path}: header must hold exactly {list(HEADER_KEYS)}")
        if header["version"] != VERSION:
            raise ExpertCacheError(
                f"{path}: trace version {header['version']!r}, expected {VERSION}"
            )
        try:
            trace = cls(header["num_layers"], header["num_experts"], header["top_k"])
        except ExpertCacheError as e:
            raise ExpertCacheError(f"{path}: header: {e}") from None
        records, width = header["records"], 2 + trace.top_k
        payload = body[12 + n :]
        if not is_int(records) or records < 0 or len(payload) != records * width * 4:
            raise ExpertCacheError(
                f"{path}: {len(payload)} payload bytes, header says {records!r} records "
                f"of {width} int32"
            )
        rows = np.frombuffer(payload, dtype="<i4").reshape(-1, width)
        _check_rows(path, rows, trace)
        trace._rows = list(rows.astype(np.int32))
        return trace


def _check_rows(path: Path, rows: np.ndarray, trace: RouterTrace) -> None:
    """Layers in range, tokens >= 0, expert ids in range and distinct within a row."""
    if not len(rows):
        return
    bad = (rows[:, 0] < 0) | (rows[:, 0] >= trace.num_layers) | (rows[:, 1] < 0)
    experts = rows[:, 2:]
    bad |= ((experts < 0) | (experts >= trace.num_experts)).any(axis=1)
    ordered = np.sort(experts, axis=1)
    bad |= (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ExpertCacheError(
            f"{path}: record {i} = {rows[i].tolist()}: expected (layer in [0, "
            f"{trace.num_layers}), token >= 0, {trace.top_k} distinct experts in [0, "
            f"{trace.num_experts}))"
        )
