"""CompressedSparseMLP: a SparseMLP over a compressed pool (pool file format 2), each
token's rows decompressed from their zstd frames where they lie in the mapping; with
``keep_decoded``, the rows a layer has decompressed stay in anonymous memory, so each is
read and decompressed once (for a process with memory to spare)."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from paired_cache.cache import rows_mlp_split
from paired_cache.compressed_pool import CompressedLayer, FrameReader, RowScratch
from paired_cache.errors import PairedCacheError
from paired_cache.grid_pool import GridReader
from paired_cache.mask_sources import Activation, MaskSource
from paired_cache.pool_file import PoolFile
from paired_cache.registry import make_source, source_class
from paired_cache.sparse_base import CachedMLP, check_prefill, check_window
from paired_cache.sparse_mlp import SparseMLP, _layer_options, check_in_place_window

#: Rows a dense prefill over rows not kept decompresses at a time (the scratch it holds).
DENSE_BLOCK_ROWS = 128


class CompressedSparseMLP(SparseMLP):
    """down(act(gate x) * up x) over the rows a mask source picks, read in place from a
    compressed pool: the gate is the gate_proj child (mapped from the safetensors; the
    pool holds none), and a token's rows are decoded into a scratch the pool file's
    layers share (``RowScratch``), reused from token to token. No PairedCache and no
    active rows: rows="in_place", window 1.
    ``keep_decoded(True)`` keeps every row decompressed so far (at most the layer's
    ``decoded_bytes``) and reads only the rows not yet kept.

    forward: x (..., hidden) float -> (..., hidden). Its products are those of SparseMLP's
    in-place torch path (and of its dense prefill) over the same rows, in the same order.
    """

    def __init__(
        self,
        frames: FrameReader | GridReader,
        gate: torch.Tensor,
        act: Activation,
        source: MaskSource,
        prefill: str = "sparse",
        scratch: RowScratch | None = None,
    ) -> None:
        """frames: the layer's FrameReader (zstd) or GridReader (grid); gate: (N, up_cols)
        the gate weights; source: a mask source that returns act(gate x) (gives_gate);
        scratch: where decoded rows are written (a new one when None)."""
        CachedMLP.__init__(self)
        check_prefill(prefill)
        if not source.gives_gate or source.n_rows != frames.n_rows:
            raise PairedCacheError(
                f"a compressed pool needs a mask source over its {frames.n_rows} rows that "
                f"computes act(gate x) (cats, trained with a gated predictor), got "
                f"{type(source).__name__} over {source.n_rows}"
            )
        self.frames, self.act_fn, self.source, self.window = frames, act, source, 1
        self.in_place, self.prefill = True, prefill
        self._will_read_pool = None
        self.will_read_rows = None  # as SparseMLP's: called with a token's rows first
        self.tokens = 0
        self.pool_rows_read = 0
        self._bytes_read = 0
        self._kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._all_kept = False
        # Where decoded rows go; from_pool_file shares its pool file's between layers.
        self.scratch = scratch if scratch is not None else RowScratch()
        self.use_gate_proj(gate)

    @property
    def decoded_bytes(self) -> int:
        """Bytes of every row decompressed (up | down_T): what keep_decoded holds at most."""
        return self.frames.n_rows * self.frames.frame_size

    @property
    def kept_rows(self) -> int:
        """Rows kept decompressed (0 unless keep_decoded)."""
        return 0 if self._kept is None else int(self._kept[2].sum())

    def keep_decoded(self, keep: bool = True) -> None:
        """Keep the rows this layer decompresses from now on, or drop them.

        Kept rows live in two (N, up_cols) and (N, hidden) tensors of anonymous memory,
        filled as tokens pick rows (a dense prefill fills them all); a token then reads and
        decompresses only its rows not kept yet. Its products are unchanged: the same
        rows, in the same order, as without.

        Args:
            keep: True keeps them, False drops those kept.
        """
        if not isinstance(keep, bool):
            raise PairedCacheError(f"keep must be a bool, got {keep!r}")
        if not keep:
            self._kept, self._all_kept = None, False
        elif self._kept is None:
            f = self.frames
            self._kept = (
                torch.empty(f.n_rows, f.up_cols, dtype=f.dtype),
                torch.empty(f.n_rows, f.hidden, dtype=f.dtype),
                torch.zeros(f.n_rows, dtype=torch.bool),
            )

    def _decode(self, idx: np.ndarray | None, ask: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(up, down_T) of rows idx ((m,) int64 ascending; None: every row) decompressed
        from the pool into the scratch (valid until the next decode of a layer sharing
        it); counts their bytes, and first asks will_read_rows for them (ask)."""
        f = self.frames
        self._count_read(idx, ask)
        m = f.n_rows if idx is None else int(idx.shape[0])
        return f.rows(idx, out=self.scratch.take(m, f.up_cols, f.hidden, f.dtype))

    def _count_read(self, idx: np.ndarray | None, ask: bool) -> None:
        """Count the pool bytes of rows idx (None: every row) as read; first ask
        will_read_rows for them (ask)."""
        f = self.frames
        if idx is None:
            self._bytes_read += f.total_bytes
            return
        if ask and self.will_read_rows is not None and idx.shape[0]:
            self.will_read_rows(torch.from_numpy(idx))
        self._bytes_read += f.compressed_bytes(idx)

    def _fill_kept(self, at: torch.Tensor | None) -> None:
        """Decompress into the kept rows those of ``at`` ((m,) int64; None: every row) not
        kept yet."""
        kept_up, kept_down, have = self._kept
        if self._all_kept:
            return
        missing = torch.arange(self.frames.n_rows)[~have] if at is None else at[~have[at]]
        if missing.shape[0]:
            kept_up[missing], kept_down[missing] = self._decode(missing.numpy(), ask=at is not None)
            have[missing] = True
            self._all_kept = bool(have.all())

    def _read_rows(self, idx: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(up (m, up_cols), down_T (m, hidden)) of rows idx ((m,) int64 ascending; None:
        every row, a dense prefill): taken from the kept rows, once those not kept yet are
        decompressed into them; without keep_decoded, all decompressed."""
        if self._kept is None:
            return self._decode(idx, ask=True)
        at = None if idx is None else torch.from_numpy(idx)
        self._fill_kept(at)
        kept_up, kept_down, _ = self._kept
        if at is None:
            return kept_up, kept_down
        return kept_up.index_select(0, at), kept_down.index_select(0, at)

    def _held_rows(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(up, down_T, at): two arrays holding rows idx ((m,) int64 ascending) at the
        positions at ((m,) int32), with no gather: the kept rows (filled first), or the
        rows just decompressed (at 0..m-1)."""
        if self._kept is None:
            up, down_T = self._decode(idx, ask=True)
            return up, down_T, torch.arange(idx.shape[0], dtype=torch.int32)
        at = torch.from_numpy(idx)
        self._fill_kept(at)
        return self._kept[0], self._kept[1], at.to(torch.int32)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.frames.dtype

    @property
    def pool_bytes_read(self) -> int:
        """Compressed bytes read from the pool since construction: the frames of every
        token's rows (and of every row for a dense prefill)."""
        return self._bytes_read

    @classmethod
    def from_pool_file(
        cls,
        pool_file: PoolFile,
        layer: int | str,
        act: Activation,
        source: str,
        fraction: float,
        *,
        gate: torch.Tensor | None = None,
        rows: str = "in_place",
        window: int = 1,
        prefill: str = "sparse",
        calibration: torch.Tensor | None = None,
        config=None,
        **options,
    ) -> CompressedSparseMLP:
        """A CompressedSparseMLP over one layer of a compressed PoolFile.

        Args:
            pool_file: a PoolFile whose ``compressed`` is True.
            layer: the layer, by name or index.
            act: the MLP's activation.
            source: a MASK_SOURCES name that computes act(gate x): "cats", or "trained"
                with a gated predictor (weights=).
            fraction: the share of the rows each token reads, in (0, 1].
            gate: (N, up_cols) of the pool's dtype, gate_proj.weight (load_sparse maps
                it from the safetensors); required, the pool holds no gate.
            rows: "in_place", the only mode a compressed pool has.
            window: 1, as for any in-place read.
            prefill: "sparse" or "dense" (every frame decompressed once for the prompt).
            calibration, config, **options: as SparseMLP.from_pool_file (config is
                accepted for a uniform call and unused: no PairedCache is made).

        Returns:
            The CompressedSparseMLP.

        Raises:
            PairedCacheError: rows other than "in_place", no gate or a gate that does not
                fit, a source that does not compute act(gate x), a format-1 pool.
        """
        del config  # no PairedCache: nothing to configure
        source_class(source)
        check_window(window)
        check_prefill(prefill)
        if rows != "in_place":
            raise PairedCacheError(
                f"rows={rows!r}: a compressed pool's rows are zstd frames, decompressed per "
                f"token; use rows='in_place', or an uncompressed pool (convert without "
                f"compress) for rows='copy'"
            )
        check_in_place_window(window)
        if not isinstance(pool_file, PoolFile) or not pool_file.compressed:
            raise PairedCacheError("pool_file must be a compressed PoolFile (format 2)")
        index = pool_file.resolve(layer)
        spec = pool_file.layers[index]
        # Per-layer options (load_sparse's predictor weights): this layer's.
        options = _layer_options(options, index)
        _check_gives_gate(spec, source, options)
        _check_gate(pool_file, spec, gate)
        src = make_source(source, gate, None, act, fraction, calibration, **options)
        sparse = cls(pool_file.frame_reader(index), gate, act, src, prefill, pool_file.scratch)
        sparse._will_read_pool = functools.partial(pool_file.will_need, index)
        return sparse

    def _in_place_forward(
        self, x: torch.Tensor, idx: torch.Tensor, gate_at: torch.Tensor | None
    ) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over the rows idx ((m,) int32, ascending), their
        frames decompressed in one call; gate_at: (m,) act(gate x) at those rows."""
        rows = idx.numpy().astype(np.int64)
        self.pool_rows_read += rows.shape[0]
        if (
            x.shape[0] == 1
            and gate_at.dtype == torch.float32
            and self.frames.dtype == torch.float32
        ):
            if self._kept is None and hasattr(self.frames, "rows_mlp"):
                # A grid pool: each record decoded in C as it is multiplied, where it lies
                # in the mapping; no rows decoded into the scratch, which a dense prefill
                # left holding a block of rows, so it is given back.
                self._count_read(rows, ask=True)
                self.scratch.release()
                return self.frames.rows_mlp(x[0], gate_at, rows).unsqueeze(0)
            # The C kernel: each row's up and down_T read once where they lie (kept or
            # just decoded), as SparseMLP's in-place float32 path does over a pool.
            up, down_T, at = self._held_rows(rows)
            return rows_mlp_split(x[0], gate_at, at, up, down_T).unsqueeze(0)
        up, down_T = self._read_rows(rows)  # (m, up_cols), (m, hidden)
        h = gate_at * F.linear(x, up)  # (T, m)
        return h @ down_T  # (T, m) @ (m, hidden)

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over every row: every frame decompressed once.

        Kept rows are multiplied at once. Rows not kept are decompressed DENSE_BLOCK_ROWS
        at a time into the scratch and their products summed block by block, so a prefill
        holds a block of decoded rows, not a layer's (SmolLM2: 0.56 MiB, not 6.75, of
        anonymous memory a hard limit takes from the page cache)."""
        if self._will_read_pool is not None:
            self._will_read_pool()
        f = self.frames
        self.pool_rows_read += f.n_rows
        if self._kept is not None:
            up, down_T = self._read_rows(None)  # (N, up_cols), (N, hidden)
            return (self.act_fn(self.gate_proj(x)) * F.linear(x, up)) @ down_T
        self._count_read(None, ask=False)
        gate = self.act_fn(self.gate_proj(x))  # (T, N)
        out = None
        for s in range(0, f.n_rows, DENSE_BLOCK_ROWS):
            e = min(f.n_rows, s + DENSE_BLOCK_ROWS)
            idx = np.arange(s, e, dtype=np.int64)
            up, down_T = f.rows(idx, out=self.scratch.take(e - s, f.up_cols, f.hidden, f.dtype))
            part = (gate[:, s:e] * F.linear(x, up)) @ down_T  # (T, hidden)
            out = part if out is None else out.add_(part)
        return out


def _check_gives_gate(spec: CompressedLayer, source: str, options: dict) -> None:
    if not source_class(source).gives_gate_for(**options):
        raise PairedCacheError(
            f"{spec.name}: mask source {source!r} does not compute act(gate x), and a "
            f"compressed pool holds no gate: use cats or trained with a gated predictor, "
            f"or an uncompressed pool converted with its gate"
        )


def _check_gate(pool_file: PoolFile, spec: CompressedLayer, gate) -> None:
    """Refuse a gate that is not a tensor of the layer's (N, up_cols) and the pool's dtype."""
    if (
        not isinstance(gate, torch.Tensor)
        or gate.shape != (spec.n_rows, spec.up_cols)
        or gate.dtype != pool_file.dtype
    ):
        got = f"{tuple(gate.shape)} {gate.dtype}" if isinstance(gate, torch.Tensor) else gate
        raise PairedCacheError(
            f"{spec.name}: a compressed pool holds no gate; pass gate=, the "
            f"({spec.n_rows}, {spec.up_cols}) {pool_file.dtype} gate_proj weight (load_sparse "
            f"maps it from the safetensors), got {got}"
        )


def keep_decoded(model: torch.nn.Module, max_bytes: int) -> list[str]:
    """Keep decompressed rows in the model's CompressedSparseMLPs, layers in the order the
    model runs them, as many whole layers as ``max_bytes`` holds (each costs its
    ``decoded_bytes`` once all its rows are read); every other layer keeps none.

    For a process with memory to spare: a kept row is read from storage and decompressed
    once, not at every token that picks it. Memory grows as rows are first read, up to the
    kept layers' decoded bytes.

    Args:
        model: a model from ``load_sparse`` over a compressed pool.
        max_bytes: bytes of anonymous memory the kept rows may take, an int >= 0.

    Returns:
        The names of the layers that keep their rows.

    Raises:
        PairedCacheError: a bad max_bytes, or a model with no CompressedSparseMLP.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise PairedCacheError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, CompressedSparseMLP)]
    if not layers:
        raise PairedCacheError(
            "the model has no CompressedSparseMLP: keep_decoded is for a model load_sparse "
            "built over a compressed pool (convert(..., compress=True))"
        )
    kept, used = [], 0
    for name, mlp in layers:
        fits = used + mlp.decoded_bytes <= max_bytes
        mlp.keep_decoded(fits)
        if fits:
            kept.append(name)
            used += mlp.decoded_bytes
    return kept


__all__ = ["CompressedSparseMLP", "keep_decoded"]
