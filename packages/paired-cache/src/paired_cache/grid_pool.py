"""Grid pools (pool file format 3): each neuron's up row and down_T row stored as the
block-quantized codes they were dequantized from, so that a token reads a few hundred
bytes per row and decodes them exactly, bit for bit, to the float32 weights.

Weights dequantized from a GGUF (SmolLM2's float copy, any model loaded from a Q4_1 or
Q8_0 file) lie on a grid: every block of BLOCK consecutive inputs of a row is
``d * q + m`` (q4_1: 4-bit q, float16 d and m) or ``d * q`` (q8_0: 8-bit signed q, float16
d), computed in float32. ``find_grid`` recovers d, q (and m) from the floats and checks that
decoding them gives every value back bit for bit; a layer that is not exactly on a grid is
refused by name (write it with the zstd codec instead). Nothing is rounded.

A layer's bytes in the file (N rows, h inputs to up, H outputs of down):

    page-aligned      N records of ``record_bytes``, one per neuron:
                        up codes (h values) | up d (h / BLOCK float16) [| up m] |
                        down_T codes (H values)
    then              the down scales, shared by BLOCK neurons: d as (N / BLOCK, H) float16
                      [then m, same shape]

4-bit codes are packed two per byte, the even value in the low nibble (an odd count's
last high nibble is 0); 8-bit codes are int8. Down's blocks run along the neurons (its inputs), so a neuron's down_T row has one
code per output and takes its d (and m) from row ``neuron // BLOCK`` of the scale table.

On SmolLM2-135M (every MLP weight Q4_1) a record is 648 bytes against 4,608 in float32
and about 2,680 as a zstd frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paired_cache._core import check_kernel_rc, ffi, lib
from paired_cache.compressed_pool import DECODE_ROWS, GatelessLayer, check_out
from paired_cache.errors import PairedCacheError

CODEC = "grid"
BLOCK = 32
# kind -> (bits per code, whether the block has an offset m)
KINDS = {"q4_1": (4, True), "q8_0": (8, False)}
F16 = torch.float16


@dataclass(frozen=True)
class Grid:
    """One weight on a grid: q (rows, cols) int16 codes, d and m (rows, cols / BLOCK)
    float16 (m None for a kind without an offset)."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def dequantize(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """q (..., n, BLOCK) codes as float32, d, m (..., n) float16 -> (..., n, BLOCK) float32:
    d * q (+ m), one float32 rounding per operation, as a GGUF dequantizes."""
    out = d.float().unsqueeze(-1) * q
    return out if m is None else out + m.float().unsqueeze(-1)


def _try(kind: str, blocks: torch.Tensor) -> Grid | None:
    """blocks (rows, n, BLOCK) float32 -> their Grid of this kind, or None when some value
    is not d * q (+ m) for float16 d (and m) and an in-range q."""
    bits, affine = KINDS[kind]
    with torch.no_grad():
        if affine:
            lo, hi = blocks.amin(-1), blocks.amax(-1)
            m = lo.to(F16)
            if not torch.equal(_bits(m.float()), _bits(lo)):
                return None
            d = ((hi - lo) / (2**bits - 1)).to(F16)
            qmin, qmax = 0, 2**bits - 1
            base = blocks - m.float().unsqueeze(-1)
        else:
            amax = blocks.abs().amax(-1)
            d = (amax / (2 ** (bits - 1) - 1)).to(F16)
            m, qmin, qmax = None, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
            base = blocks
        if not torch.isfinite(d).all():
            return None
        step = d.float().unsqueeze(-1)
        q = torch.where(step > 0, torch.round(base / torch.where(step > 0, step, 1)), 0)
        q = q.clamp(qmin, qmax).to(torch.int16).float()  # as stored: no -0.0
        if not torch.equal(_bits(dequantize(kind, q, d, m)), _bits(blocks)):
            return None
    return Grid(kind, q.to(torch.int16).flatten(1), d, m)


def find_grid(name: str, w: torch.Tensor) -> Grid:
    """The grid w (rows, cols) float32 lies on, blocks of BLOCK along cols: the first of
    KINDS that gives every value back bit for bit.

    Raises:
        PairedCacheError: naming the layer, when w is not float32, its columns are not a
            multiple of BLOCK, or no kind gives it back exactly.
    """
    if w.dtype != torch.float32:
        raise PairedCacheError(
            f"{name}: a grid pool holds float32 weights dequantized from blocks, got "
            f"{w.dtype}; use the zstd codec"
        )
    rows, cols = w.shape
    if cols % BLOCK:
        raise PairedCacheError(
            f"{name}: {cols} inputs are not a multiple of the grid's block of {BLOCK}; use "
            f"the zstd codec"
        )
    blocks = w.detach().contiguous().view(rows, cols // BLOCK, BLOCK)
    for kind in KINDS:
        grid = _try(kind, blocks)
        if grid is not None:
            return grid
    raise PairedCacheError(
        f"{name}: the weights are not exactly on a {' or '.join(KINDS)} grid of {BLOCK} "
        f"(as a GGUF of those types dequantizes to); a grid pool stores only weights it "
        f"gives back bit for bit: use the zstd codec"
    )


def _code_bytes(kind: str, n: int) -> int:
    return (n * KINDS[kind][0] + 7) // 8


def _pack(kind: str, q: torch.Tensor) -> np.ndarray:
    """q (rows, cols) int16 -> (rows, code bytes) uint8."""
    if KINDS[kind][0] == 8:
        return q.to(torch.int8).view(torch.uint8).numpy()
    u = q.to(torch.uint8)
    if u.shape[1] % 2:  # an odd count: the last byte's high nibble is 0
        u = torch.cat((u, torch.zeros(u.shape[0], 1, dtype=torch.uint8)), dim=1)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).numpy()


def _unpack(kind: str, codes: torch.Tensor, cols: int) -> torch.Tensor:
    """codes (m, code bytes) uint8 -> (m, cols) float32 codes."""
    if KINDS[kind][0] == 8:
        return codes.view(torch.int8).float()
    pairs = torch.stack((codes & 15, codes >> 4), dim=-1)  # (m, ceil(cols / 2), 2)
    return pairs.view(codes.shape[0], -1)[:, :cols].float()


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy of t (contiguous() keeps a one-row slice's record-wide stride,
    which a view as float16 refuses)."""
    return t.clone(memory_format=torch.contiguous_format)


def _f16_bytes(t: torch.Tensor) -> np.ndarray:
    """(rows, n) float16 -> (rows, 2 n) uint8, row-major whatever t's strides."""
    return np.ascontiguousarray(t.numpy()).view(np.uint8)


@dataclass(frozen=True)
class GridLayer(GatelessLayer):
    """One MLP's grid pool inside the file: N records then the down scales; up_kind and
    down_kind among KINDS."""

    up_kind: str
    down_kind: str

    @property
    def record_bytes(self) -> int:
        return record_bytes(self.up_kind, self.down_kind, self.up_cols, self.hidden)

    @property
    def table_bytes(self) -> int:
        affine = KINDS[self.down_kind][1]
        return (2 if affine else 1) * (self.n_rows // BLOCK) * self.hidden * 2

    @property
    def expected_bytes(self) -> int:
        return self.n_rows * self.record_bytes + self.table_bytes


def record_bytes(up_kind: str, down_kind: str, up_cols: int, hidden: int) -> int:
    """Bytes of one neuron's record: up codes, up scales, down_T codes."""
    scales = (up_cols // BLOCK) * 2 * (2 if KINDS[up_kind][1] else 1)
    return _code_bytes(up_kind, up_cols) + scales + _code_bytes(down_kind, hidden)


def encode_layer(name: str, up: torch.Tensor, down: torch.Tensor) -> tuple[bytes, str, str]:
    """up: (N, h), down: (H, N), float32 on grids -> (the layer's bytes, up kind, down kind).
    PairedCacheError naming the layer when either weight is not exactly on a grid, or N
    is not a multiple of BLOCK."""
    n = up.shape[0]
    if n % BLOCK:
        raise PairedCacheError(
            f"{name}: {n} neurons are not a multiple of the grid's block of {BLOCK} (down's "
            f"blocks run along them); use the zstd codec"
        )
    gu = find_grid(f"{name}.up", up)
    gd = find_grid(f"{name}.down", down)
    parts = [_pack(gu.kind, gu.q), _f16_bytes(gu.d)]
    if gu.m is not None:
        parts.append(_f16_bytes(gu.m))
    parts.append(_pack(gd.kind, gd.q.t().contiguous()))  # (N, H): each neuron's down_T
    records = np.concatenate(parts, axis=1)
    tables = [_f16_bytes(gd.d.t())]  # (N / BLOCK, H)
    if gd.m is not None:
        tables.append(_f16_bytes(gd.m.t()))
    data = records.tobytes() + b"".join(t.tobytes() for t in tables)
    # Decoded from the bytes written, every row must give the weights back bit for bit.
    reader = GridReader(memoryview(data), 0, n, up.shape[1], down.shape[0], gu.kind, gd.kind)
    got_up, got_down = reader.rows(None)
    if not (
        torch.equal(_bits(got_up), _bits(up)) and torch.equal(_bits(got_down), _bits(down.t()))
    ):
        raise PairedCacheError(f"{name}: the grid codes do not decode to the weights")
    return data, gu.kind, gd.kind


class GridReader:
    """Decodes rows of one grid layer, read where its records lie in the mapping: the same
    interface as FrameReader (rows, compressed_bytes, byte_runs, frame_size).

    data: the layer's bytes (a slice of the mapping, no copy); begin: its file offset."""

    def __init__(
        self,
        data: memoryview,
        begin: int,
        n_rows: int,
        up_cols: int,
        hidden: int,
        up_kind: str,
        down_kind: str,
    ) -> None:
        self.n_rows, self.up_cols, self.hidden = n_rows, up_cols, hidden
        self.up_kind, self.down_kind, self.dtype = up_kind, down_kind, torch.float32
        self.begin = begin
        self.record_bytes = record_bytes(up_kind, down_kind, up_cols, hidden)
        self.frame_size = (up_cols + hidden) * 4  # decoded bytes of a row
        whole = np.frombuffer(data, dtype=np.uint8)
        end = n_rows * self.record_bytes
        self.records = whole[:end].reshape(n_rows, self.record_bytes)
        groups = n_rows // BLOCK
        # Small, and read by every token: kept in memory. Read from the mapping, its pages
        # went with the pool's, paged out after each token under a hard limit, and the
        # kernel faulted them back one at a time (SmolLM2 under tight: 0.74 tokens/s
        # against 0.99, 2026-12-07).
        table = torch.from_numpy(whole[end:].copy()).view(F16)
        self.table_row_bytes = hidden * 2 * (2 if KINDS[down_kind][1] else 1)
        self.down_d = table[: groups * hidden].view(groups, hidden)
        self.down_m = table[groups * hidden :].view(groups, hidden) if KINDS[down_kind][1] else None
        u_codes = _code_bytes(up_kind, up_cols)
        u_scales = (up_cols // BLOCK) * 2
        self._cuts = (
            u_codes,
            u_codes + u_scales,
            u_codes + u_scales * (2 if KINDS[up_kind][1] else 1),
        )
        self.table_begin = begin + end

    def compressed_bytes(self, idx: np.ndarray | None) -> int:
        """Bytes of rows idx' records (None: every row): what a token reads. The down
        scales are read once, when the reader is made, and kept in memory (SmolLM2: 110
        KiB a layer)."""
        m = self.n_rows if idx is None else int(idx.shape[0])
        return m * self.record_bytes

    @property
    def total_bytes(self) -> int:
        return self.compressed_bytes(None)

    def byte_runs(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(begins, ends): the file's byte range of each row's record, rows idx ascending."""
        begins = self.begin + idx * self.record_bytes
        return begins, begins + self.record_bytes

    def rows(
        self,
        idx: np.ndarray | None = None,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows idx ((m,) int64 ascending; None: every row), decoded: (up (m, up_cols),
        down_T (m, hidden)), each contiguous float32, bit for bit the weights written.

        The rows are decoded DECODE_ROWS at a time, so the temporaries of a decode stay
        small whatever m is. ``out``: two contiguous float32 tensors of those shapes to
        decode into (a reused scratch), returned; fresh tensors when None."""
        m = self.n_rows if idx is None else int(idx.shape[0])
        up, down = check_out(out, m, self.up_cols, self.hidden, torch.float32)
        for s in range(0, m, DECODE_ROWS):
            e = min(m, s + DECODE_ROWS)
            if idx is None:
                records = torch.from_numpy(np.array(self.records[s:e]))  # the pages read
                groups = torch.arange(s, e) // BLOCK
            else:
                records = torch.from_numpy(self.records[idx[s:e]])  # a copy: pages read
                groups = torch.from_numpy(idx[s:e]) // BLOCK
            self._decode_block(records, groups, up[s:e], down[s:e])
        return up, down

    def rows_mlp(self, x: torch.Tensor, g: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
        """One token's sparse MLP over rows idx, decoded in C one record at a time where it
        lies in the mapping: sum over k of g[k] * (x . up[idx[k]]) * down_T[idx[k]], as
        (hidden,). Nothing is copied out of the mapping; the products and their order are
        those of ``rows_mlp_split`` over ``rows(idx)``, bit for bit.

        Args:
            x: (up_cols,) float32.
            g: (m,) float32, act(gate x) at the rows idx.
            idx: (m,) int64 row ids in [0, n_rows).

        Raises:
            PairedCacheError: any other input (a row id out of range included), before
                anything is computed.
        """
        m = idx.shape[0] if isinstance(idx, np.ndarray) and idx.ndim == 1 else -1
        if m < 0 or idx.dtype != np.int64:
            raise PairedCacheError(
                f"GridReader.rows_mlp: idx must be a 1-D int64 array, got "
                f"{getattr(idx, 'dtype', type(idx).__name__)}"
            )
        for name, t, shape in (("x", x, (self.up_cols,)), ("g", g, (m,))):
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != torch.float32
                or t.device.type != "cpu"
            ):
                raise PairedCacheError(
                    f"GridReader.rows_mlp: {name} must be a CPU float32 tensor, got "
                    f"{getattr(t, 'dtype', type(t).__name__)}"
                )
            if tuple(t.shape) != shape:
                raise PairedCacheError(
                    f"GridReader.rows_mlp: {name} has shape {tuple(t.shape)}, expected {shape}"
                )
        x, g, idx = x.contiguous(), g.contiguous(), np.ascontiguousarray(idx)
        row = torch.empty(self.up_cols + self.hidden, dtype=torch.float32)
        out = torch.empty(self.hidden, dtype=torch.float32)
        rc = lib.pc_grid_rows_mlp_f32(
            ffi.cast("float *", x.data_ptr()),
            ffi.cast("float *", g.data_ptr()),
            ffi.cast("int64_t *", idx.ctypes.data),
            m,
            ffi.cast("uint8_t *", self.records.ctypes.data),
            self.record_bytes,
            self.n_rows,
            KINDS[self.up_kind][0],
            int(KINDS[self.up_kind][1]),
            self.up_cols,
            KINDS[self.down_kind][0],
            ffi.cast("uint16_t *", self.down_d.data_ptr()),
            ffi.NULL if self.down_m is None else ffi.cast("uint16_t *", self.down_m.data_ptr()),
            self.hidden,
            ffi.cast("float *", row.data_ptr()),
            ffi.cast("float *", out.data_ptr()),
        )
        check_kernel_rc("GridReader.rows_mlp", rc, self.n_rows)
        return out

    def _decode_block(
        self, records: torch.Tensor, groups: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> None:
        """records (n, record_bytes) uint8, groups (n,) their down scale rows -> up (n,
        up_cols) and down (n, hidden), written in place: d * q (+ m), one float32 rounding
        per operation (dequantize's)."""
        n = records.shape[0]
        a, b, c = self._cuts
        nb = self.up_cols // BLOCK
        q_up = _unpack(self.up_kind, records[:, :a], self.up_cols).view(n, nb, BLOCK)
        d_up = _owned(records[:, a:b]).view(F16).float().unsqueeze(-1)  # (n, nb, 1)
        blocks = up.view(n, nb, BLOCK)
        torch.mul(d_up, q_up, out=blocks)
        if c > b:
            blocks.add_(_owned(records[:, b:c]).view(F16).float().unsqueeze(-1))
        q_down = _unpack(self.down_kind, _owned(records[:, c:]), self.hidden)
        torch.mul(self.down_d.index_select(0, groups).float(), q_down, out=down)
        if self.down_m is not None:
            down.add_(self.down_m.index_select(0, groups).float())


__all__ = [
    "BLOCK",
    "CODEC",
    "KINDS",
    "Grid",
    "GridLayer",
    "GridReader",
    "dequantize",
    "encode_layer",
    "find_grid",
    "record_bytes",
]
