"""Router traces: which experts each MoE layer chose for each token, saved to a file.

File format (version 1): the 8 bytes ``MOETRACE``, a little-endian uint32 header length,
a UTF-8 JSON header ``{"version", "num_layers", "num_experts", "top_k", "records",
"sha256"}``, then ``records`` rows of int32 ``(layer, token, expert_1 .. expert_k)``.
The SHA-256 covers the rows; sizes are checked before anything is allocated.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MOETRACE"
VERSION = 1


class RouterTrace:
    """Records ``(layer, token, expert ids)``; ``rows()`` is int32 (records, 2 + top_k)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        if min(num_layers, num_experts, top_k) < 1 or top_k > num_experts:
            raise ValueError(
                f"need num_layers >= 1 and 1 <= top_k <= num_experts, got "
                f"{num_layers}, {num_experts}, {top_k}"
            )
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self._rows: list[np.ndarray] = []

    def append(self, layer: int, token: int, experts) -> None:
        experts = np.asarray(experts, dtype=np.int32).ravel()
        if experts.size != self.top_k or not 0 <= layer < self.num_layers:
            raise ValueError(f"record ({layer}, {token}, {experts}) does not fit this trace")
        if experts.min() < 0 or experts.max() >= self.num_experts:
            raise ValueError(f"expert ids {experts} outside [0, {self.num_experts})")
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
        path = Path(path)
        payload = np.ascontiguousarray(self.rows(), dtype="<i4").tobytes()
        header = json.dumps(
            {
                "version": VERSION,
                "num_layers": self.num_layers,
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "records": len(self._rows),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        ).encode()
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> RouterTrace:
        path = Path(path)
        data = path.read_bytes()
        if data[:8] != MAGIC or len(data) < 12:
            raise ValueError(f"{path} is not a router trace (bad magic)")
        (n,) = struct.unpack("<I", data[8:12])
        if 12 + n > len(data):
            raise ValueError(f"{path}: truncated header")
        header = json.loads(data[12 : 12 + n])
        if header.get("version") != VERSION:
            raise ValueError(f"{path}: trace version {header.get('version')}, expected {VERSION}")
        width = 2 + header["top_k"]
        payload = data[12 + n :]
        if len(payload) != header["records"] * width * 4:
            raise ValueError(
                f"{path}: {len(payload)} payload bytes, header says {header['records']} records"
            )
        if hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError(f"{path}: checksum mismatch (corrupted trace)")
        trace = cls(header["num_layers"], header["num_experts"], header["top_k"])
        rows = np.frombuffer(payload, dtype="<i4").reshape(-1, width)
        trace._rows = list(rows.astype(np.int32))
        return trace
