"""CompressedSparseMLP: a SparseMLP over a compressed pool (pool file format 2), each
token's rows decompressed from their zstd frames where they lie in the mapping."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from paired_cache.compressed_pool import FrameReader
from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import Activation, MaskSource
from paired_cache.pool_file import PoolFile
from paired_cache.registry import make_source, source_class
from paired_cache.sparse_base import CachedMLP, check_prefill, check_window
from paired_cache.sparse_mlp import SparseMLP, _layer_options, check_in_place_window


class CompressedSparseMLP(SparseMLP):
    """down(act(gate x) * up x) over the rows a mask source picks, read in place from a
    compressed pool: the gate is the gate_proj child (mapped from the safetensors; the
    pool holds none), and a token's rows are decompressed in one call into temporaries
    freed after the layer. No PairedCache and no active rows: rows="in_place", window 1.

    forward: x (..., hidden) float -> (..., hidden). Its products are those of SparseMLP's
    in-place torch path (and of its dense prefill) over the same rows, in the same order.
    """

    def __init__(
        self,
        frames: FrameReader,
        gate: torch.Tensor,
        act: Activation,
        source: MaskSource,
        prefill: str = "sparse",
    ) -> None:
        """frames: the layer's FrameReader; gate: (N, up_cols) the gate weights; source: a
        mask source that returns act(gate x) (gives_gate)."""
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
        self.use_gate_proj(gate)

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
        if not source_class(source).gives_gate_for(**options):
            raise PairedCacheError(
                f"{spec.name}: mask source {source!r} does not compute act(gate x), and a "
                f"compressed pool holds no gate: use cats or trained with a gated predictor, "
                f"or an uncompressed pool converted with its gate"
            )
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
        src = make_source(source, gate, None, act, fraction, calibration, **options)
        sparse = cls(pool_file.frame_reader(index), gate, act, src, prefill)
        sparse._will_read_pool = functools.partial(pool_file.will_need, index)
        return sparse

    def _in_place_forward(
        self, x: torch.Tensor, idx: torch.Tensor, gate_at: torch.Tensor | None
    ) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over the rows idx ((m,) int32, ascending), their
        frames decompressed in one call; gate_at: (m,) act(gate x) at those rows."""
        if self.will_read_rows is not None:
            self.will_read_rows(idx)
        rows = idx.numpy().astype(np.int64)
        up, down_T = self.frames.rows(rows)  # (m, up_cols), (m, hidden)
        self.pool_rows_read += rows.shape[0]
        self._bytes_read += self.frames.compressed_bytes(rows)
        h = gate_at * F.linear(x, up)  # (T, m)
        return h @ down_T  # (T, m) @ (m, hidden)

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over every row: every frame decompressed once."""
        if self._will_read_pool is not None:
            self._will_read_pool()
        up, down_T = self.frames.rows()  # (N, up_cols), (N, hidden)
        self.pool_rows_read += self.frames.n_rows
        self._bytes_read += int(self.frames.offsets[-1])
        h = self.act_fn(self.gate_proj(x)) * F.linear(x, up)  # (T, N)
        return h @ down_T


__all__ = ["CompressedSparseMLP"]
