"""PairedCache: torch-facing wrapper of the C core's paired-replacement weight cache."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from paired_cache._core import ERROR_NAMES, check_kernel_rc, core_info, ffi, lib
from paired_cache.config import MAX_ROWS, PairedCacheConfig
from paired_cache.errors import PairedCacheError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class CacheInvariantError(RuntimeError):
    """check_valid() found the cache's metadata or rows inconsistent."""


@dataclass(frozen=True)
class CacheStats:
    """Totals since construction; rows and bytes count row copies into the active buffers."""

    updates: int
    paired_updates: int
    rebuilds: int
    rows_copied: int
    bytes_moved: int


@dataclass(frozen=True)
class UpdateInfo:
    """What one update did: |added|, |removed|, rows copied, and whether it rebuilt."""

    added: int
    removed: int
    rows_copied: int
    rebuilt: bool


def _check_weight(name: str, t, shape: tuple[int | None, ...], dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise PairedCacheError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise PairedCacheError(f"{name} must be a dense (strided) tensor, got {t.layout}")
    if t.device.type != "cpu":
        raise PairedCacheError(f"{name} must be on the CPU, got device {t.device}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise PairedCacheError(f"{name} has dtype {t.dtype}; supported: {SUPPORTED_DTYPES}")
    if dtype is not None and t.dtype != dtype:
        raise PairedCacheError(f"{name} has dtype {t.dtype} but up has {dtype}")
    if t.dim() != len(shape) or any(
        w is not None and s != w for s, w in zip(t.shape, shape, strict=True)
    ):
        want = "x".join("?" if w is None else str(w) for w in shape)
        raise PairedCacheError(f"{name} has shape {tuple(t.shape)}, expected [{want}]")
    if not all(1 <= s <= MAX_ROWS for s in t.shape):
        raise PairedCacheError(
            f"{name} has shape {tuple(t.shape)}; every dimension must be in [1, {MAX_ROWS}]"
        )
    if not t.is_contiguous():
        raise PairedCacheError(f"{name} with shape {tuple(t.shape)} is not contiguous")


def _view(handle, ptr, nbytes: int, dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero-copy tensor over C memory that keeps the cache (handle) alive."""
    # The gc'd pointer's destructor closes over handle, so every view keeps the C cache
    # allocated for as long as the view lives, even after the PairedCache is dropped.
    owner = ffi.gc(ptr, lambda _ptr, _keep=handle: None)
    flat = torch.frombuffer(ffi.buffer(owner, max(nbytes, 1)), dtype=torch.uint8)
    return flat[:nbytes].view(dtype).view(shape)


def _checked_options(n: int, gate_cols: int, capacity, config, gate_rows):
    """(capacity, a private copy of config), once capacity (None: N), config and
    gate_rows are checked."""
    capacity = n if capacity is None else capacity
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= n:
        raise PairedCacheError(f"capacity must be an int in [1, N={n}], got {capacity!r}")
    config = PairedCacheConfig() if config is None else config
    if not isinstance(config, PairedCacheConfig):
        raise PairedCacheError(f"config must be a PairedCacheConfig, got {type(config).__name__}")
    # replace() runs PairedCacheConfig's checks again (a field may have been set since) and
    # keeps a copy, so later changes to the caller's config cannot reach the C core.
    config = dataclasses.replace(config)
    if not isinstance(gate_rows, bool):
        raise PairedCacheError(f"gate_rows must be a bool, got {gate_rows!r}")
    if not gate_rows and gate_cols == 0:
        raise PairedCacheError("gate_rows=False needs a gate to leave in the pool (gate=None)")
    return capacity, config


class PairedCache:
    """Rows of gate/up and of down transposed for the active neurons of one gated MLP.

    up: (N, up_cols), down: (hidden, N) (an nn.Linear weight), gate: (N, gate_cols) or
    None; one dtype among float32, float16, bfloat16, float64; CPU, contiguous. The neuron
    pool copies them, one row per neuron: neuron_pool (N, gate_cols + up_cols + hidden) holds
    gate row | up row | down column (down transposed), so that adding a neuron reads one
    contiguous run of bytes. gate_pool (N, gate_cols) (None without a gate), up_pool
    (N, up_cols) and down_pool_T (N, hidden) are strided views of its column blocks. The
    active buffers hold up to capacity rows, packed: gate | up and down_T per row, or with
    gate_rows=False up and down_T only (the gate stays in the pool, for a caller that
    computes act(gate x) from gate_pool itself, as CATS and the gated trained predictor do).
    Views returned by the accessors alias C memory that never reallocates. Not safe for concurrent updates from several threads; a
    lock serialises them.
    """

    def __init__(
        self,
        up: torch.Tensor,
        down: torch.Tensor,
        gate: torch.Tensor | None = None,
        *,
        capacity: int | None = None,
        config: PairedCacheConfig | None = None,
        init_mask: torch.Tensor | None = None,
        gate_rows: bool = True,
    ) -> None:
        _check_weight("up", up, (None, None), None)
        n, up_cols = up.shape
        _check_weight("down", down, (None, n), up.dtype)
        hidden = down.shape[0]
        gate_cols = 0
        if gate is not None:
            _check_weight("gate", gate, (n, None), up.dtype)
            gate_cols = gate.shape[1]
        self._create(
            n, gate_cols, up_cols, hidden, up.dtype, capacity, config, init_mask, None, gate_rows
        )
        with torch.no_grad():  # weights that require grad are copied as plain data
            if gate is not None:
                self.gate_pool.copy_(gate)
            self.up_pool.copy_(up)
            self.down_pool_T.copy_(down.t())  # (hidden, N) -> (N, hidden)
        if init_mask is not None:
            self.update(init_mask)

    @classmethod
    def from_pool_file(
        cls,
        pool_file,
        layer: int | str,
        *,
        capacity: int | None = None,
        config: PairedCacheConfig | None = None,
        init_mask: torch.Tensor | None = None,
        gate_rows: bool = True,
    ) -> PairedCache:
        """A cache over one layer of a PoolFile (paired_cache.pool_file), read in place.

        The neuron pool is the file's read-only mapping: updates copy rows from it into the
        active buffers (the only anonymous memory, capacity rows), and the pool views
        (neuron_pool, gate_pool, up_pool, down_pool_T) alias the mapping. Writing to those
        views faults: the mapping is read-only.

        Args:
            pool_file: an uncompressed PoolFile.
            layer: the layer, by name or index.
            capacity, config, init_mask, gate_rows: as the constructor's.

        Returns:
            The PairedCache.

        Raises:
            PairedCacheError: not a PoolFile, a compressed pool, or an unknown layer.
        """
        from paired_cache.pool_file import PoolFile

        if not isinstance(pool_file, PoolFile):
            raise PairedCacheError(f"pool_file must be a PoolFile, got {type(pool_file).__name__}")
        if pool_file.compressed:
            raise PairedCacheError(
                f"{pool_file.path} is a compressed pool: its rows are zstd frames, which a "
                f"PairedCache cannot map (CompressedSparseMLP reads them in place)"
            )
        index = pool_file.resolve(layer)
        spec = pool_file.layers[index]
        self = cls.__new__(cls)
        self._create(
            spec.n_rows,
            spec.gate_cols,
            spec.up_cols,
            spec.hidden,
            pool_file.dtype,
            capacity,
            config,
            init_mask,
            pool_file.layer_buffer(index),
            gate_rows,
        )
        if init_mask is not None:
            self.update(init_mask)
        return self

    def _create(
        self, n, gate_cols, up_cols, hidden, dtype, capacity, config, init_mask, mapped, gate_rows
    ):
        """Validate capacity, config, init_mask and gate_rows, then create the C cache and its
        views; mapped: a read-only buffer of the pool rows (pc_create_mapped), or None to
        allocate."""
        capacity, config = _checked_options(n, gate_cols, capacity, config, gate_rows)
        # Columns of gate held in the active rows: all of them, or none with gate_rows=False.
        self.gate_rows, self.active_gate_cols = gate_rows, gate_cols if gate_rows else 0
        self.n_rows, self.up_cols, self.gate_cols, self.hidden = n, up_cols, gate_cols, hidden
        self.capacity, self.config, self.dtype = capacity, config, dtype
        if init_mask is not None:
            # Validate before allocating anything.
            selected = int(self._mask_bytes(init_mask).sum())
            if selected > capacity:
                raise PairedCacheError(
                    f"init_mask selects {selected} rows but capacity is {capacity}"
                )
        self._handle = self._new_core(mapped)
        self._lock = threading.Lock()
        self._stats = ffi.new("pc_stats *")
        self._count = ffi.new("int64_t *")
        self._make_views(mapped)

    def _new_core(self, mapped):
        """The C cache for this cache's sizes and config, its pool allocated (mapped None) or
        over the mapped rows; freed when the handle is collected."""
        n, gate_cols, up_cols, hidden = self.n_rows, self.gate_cols, self.up_cols, self.hidden
        config, capacity = self.config, self.capacity
        cfg = ffi.new("pc_config *")
        cfg.n_rows, cfg.gate_cols, cfg.up_cols, cfg.hidden = n, gate_cols, up_cols, hidden
        cfg.elem_size, cfg.capacity = self.dtype.itemsize, capacity
        cfg.hybrid_tau, cfg.grain = config.hybrid_tau, config.grain
        cfg.par_threshold, cfg.num_threads = config.par_threshold, config.num_threads
        cfg.skip_gate = 0 if self.gate_rows else 1
        out = ffi.new("pc_cache **")
        if mapped is None:
            rc = lib.pc_create(cfg, out)
            keep = None
        else:
            # from_buffer takes read-only buffers; the cdata pins the mapping, and the
            # handle's destructor below keeps it alive as long as the C cache reads it.
            keep = ffi.from_buffer(mapped)
            rc = lib.pc_create_mapped(cfg, keep, out)
        if rc != lib.PC_OK:
            raise (MemoryError if rc == lib.PC_ERR_NOMEM else PairedCacheError)(
                f"pc_create failed ({ERROR_NAMES.get(rc, rc)}) for N={n}, gate_cols={gate_cols}"
                f", up_cols={up_cols}, hidden={hidden}, capacity={capacity}"
            )
        return ffi.gc(out[0], lambda ptr, _keep=keep: lib.pc_destroy(ptr))

    def _make_views(self, mapped) -> None:
        """The pool views (over the mapping when mapped) and the active buffers' views."""
        h, n, dtype, size = self._handle, self.n_rows, self.dtype, self.dtype.itemsize
        gate_cols, hidden, capacity = self.gate_cols, self.hidden, self.capacity
        row = gate_cols + self.up_cols
        # Pool rows are padded to a multiple of 64 bytes and of the element size by the core:
        # stride elements per row, of which the first gate_cols + up_cols + hidden are used.
        stride = lib.pc_pool_row_bytes(h) // size
        if mapped is None:
            padded = _view(h, lib.pc_neuron_pool(h), n * stride * size, dtype, (n, stride))
        else:
            with warnings.catch_warnings():
                # The mapping is read-only on purpose: torch warns that it cannot mark the
                # tensor so; a write through these views faults instead of copying pages.
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(mapped, dtype=torch.uint8)
            padded = flat.view(dtype).view(n, stride)
        self.neuron_pool = padded[:, : row + hidden]  # (N, gate_cols + up_cols + hidden)
        self.gate_pool = self.neuron_pool[:, :gate_cols] if gate_cols else None
        self.up_pool = self.neuron_pool[:, gate_cols:row]  # (N, up_cols)
        self.down_pool_T = self.neuron_pool[:, row:]  # (N, hidden)
        active_row = self.active_gate_cols + self.up_cols
        self._active_gate_up = _view(
            h, lib.pc_active_gate_up(h), capacity * active_row * size, dtype, (capacity, active_row)
        )
        self._active_down_T = _view(
            h, lib.pc_active_down_T(h), capacity * hidden * size, dtype, (capacity, hidden)
        )
        self._indices = _view(h, lib.pc_active_indices(h), capacity * 4, torch.int32, (capacity,))
        self._positions = _view(h, lib.pc_index_to_position(h), n * 4, torch.int32, (n,))
        self._mask = _view(h, lib.pc_current_mask(h), n, torch.bool, (n,))

    @property
    def pool_is_mapped(self) -> bool:
        """True when the neuron pool is a read-only file mapping (from_pool_file)."""
        return bool(lib.pc_pool_is_mapped(self._handle))

    def _mask_bytes(self, mask) -> torch.Tensor:
        """Validate a mask and return it as a contiguous (N,) bool tensor: N bytes of 0 or 1,
        which the C core reads as uint8."""
        if isinstance(mask, np.ndarray):
            if mask.dtype != np.bool_:
                raise PairedCacheError(f"mask must have dtype bool, got numpy {mask.dtype}")
            mask = torch.from_numpy(np.ascontiguousarray(mask))
        if not isinstance(mask, torch.Tensor):
            raise PairedCacheError(f"mask must be a bool torch.Tensor, got {type(mask).__name__}")
        if mask.layout != torch.strided:
            raise PairedCacheError(f"mask must be a dense (strided) tensor, got {mask.layout}")
        if mask.dtype != torch.bool:
            raise PairedCacheError(f"mask must have dtype torch.bool, got {mask.dtype}")
        if mask.dim() != 1 or mask.shape[0] != self.n_rows:
            raise PairedCacheError(f"mask has shape {tuple(mask.shape)}, expected ({self.n_rows},)")
        if mask.device.type != "cpu":
            raise PairedCacheError(f"mask must be on the CPU, got device {mask.device}")
        return mask if mask.is_contiguous() else mask.contiguous()

    def update(self, new_mask) -> UpdateInfo:
        """Make the active set equal to new_mask, copying only the rows that change.

        Args:
            new_mask: (N,) bool on the CPU, at most capacity rows set.

        Returns:
            The UpdateInfo: rows added, removed and copied, and whether it rebuilt.

        Raises:
            PairedCacheError: a bad mask or one over capacity (the cache is unchanged).
        """
        data = self._mask_bytes(new_mask)
        with self._lock:
            rc = lib.pc_update(self._handle, ffi.cast("uint8_t *", data.data_ptr()), self._count)
            if rc == lib.PC_ERR_CAPACITY:
                raise PairedCacheError(
                    f"mask selects {self._count[0]} rows but capacity is {self.capacity}; "
                    "the cache is unchanged"
                )
            lib.pc_get_stats(self._handle, self._stats)
            s = self._stats
            return UpdateInfo(
                s.last_added, s.last_removed, s.last_rows_copied, bool(s.last_was_rebuild)
            )

    def rows_mlp(self, x: torch.Tensor, g: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """One token's MLP over the pool rows idx, multiplied where they lie in the pool:
        sum over k of g[k] * (x . up[idx[k]]) * down_T[idx[k]], as (hidden,).

        x: (up_cols,) float32; g: (m,) float32, act(gate x) at the rows idx; idx: (m,)
        int32 row ids in [0, N). Float32 pools only. Reads only the picked rows' up and
        down_T parts, once each, and writes nothing but the result: no active rows change.
        Raises PairedCacheError, having computed nothing, for any other input.
        """
        if self.dtype != torch.float32:
            raise PairedCacheError(f"rows_mlp needs a float32 pool, this one is {self.dtype}")
        m = idx.shape[0] if isinstance(idx, torch.Tensor) and idx.dim() == 1 else -1
        for name, t, dtype, n in (
            ("x", x, torch.float32, self.up_cols),
            ("g", g, torch.float32, m),
            ("idx", idx, torch.int32, m),
        ):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu":
                raise PairedCacheError(
                    f"rows_mlp: {name} must be a CPU {dtype} tensor, got "
                    f"{getattr(t, 'dtype', type(t).__name__)}"
                )
            if t.dim() != 1 or t.shape[0] != n:
                raise PairedCacheError(
                    f"rows_mlp: {name} has shape {tuple(t.shape)}, expected ({n},)"
                    + (" (idx must be 1-D)" if n < 0 else "")
                )
        x, g, idx = x.contiguous(), g.contiguous(), idx.contiguous()
        out = torch.empty(self.hidden, dtype=torch.float32)
        rc = lib.pc_rows_mlp_f32(
            self._handle,
            ffi.cast("float *", x.data_ptr()),
            ffi.cast("float *", g.data_ptr()),
            ffi.cast("int32_t *", idx.data_ptr()),
            m,
            ffi.cast("float *", out.data_ptr()),
        )
        check_kernel_rc("rows_mlp", rc, self.n_rows)
        return out

    @property
    def num_active(self) -> int:
        """m: rows currently active."""
        return lib.pc_num_active(self._handle)

    def _need_gate_rows(self) -> None:
        if not self.gate_rows:
            raise PairedCacheError(
                "this cache keeps its gate in the pool only (gate_rows=False): the active "
                "rows hold up and down; read gate_pool"
            )

    def gate_up(self) -> torch.Tensor:
        """(m, gate_cols + up_cols): gate row then up row per active neuron, zero-copy;
        PairedCacheError with gate_rows=False."""
        self._need_gate_rows()
        return self._active_gate_up[: self.num_active]

    def gate(self) -> torch.Tensor:
        """(m, gate_cols) strided view of the gate rows; PairedCacheError without a gate
        or with gate_rows=False."""
        if self.gate_cols == 0:
            raise PairedCacheError("this cache was built without a gate (gate=None)")
        self._need_gate_rows()
        return self._active_gate_up[: self.num_active, : self.gate_cols]

    def up(self) -> torch.Tensor:
        """(m, up_cols): the up rows, a strided view (contiguous with gate_rows=False)."""
        return self._active_gate_up[: self.num_active, self.active_gate_cols :]

    def active_down_T(self) -> torch.Tensor:
        """(m, hidden) contiguous: the active rows of down transposed."""
        return self._active_down_T[: self.num_active]

    def down(self) -> torch.Tensor:
        """(hidden, m): the active columns of down, the transpose of active_down_T()."""
        return self.active_down_T().t()

    def active_indices(self) -> torch.Tensor:
        """(m,) int32 copy: the row id at each packed position."""
        return self._indices[: self.num_active].clone()

    def index_to_position(self) -> torch.Tensor:
        """(N,) int32 copy: each row id's packed position, -1 when absent."""
        return self._positions.clone()

    def mask(self) -> torch.Tensor:
        """(N,) bool copy of the current mask."""
        return self._mask.clone()

    @property
    def active_bytes(self) -> int:
        """Bytes of the m active rows (gate when gate_rows, up and down)."""
        return self.num_active * self.active_row_bytes

    @property
    def active_row_bytes(self) -> int:
        """Bytes of one active row: what adding a neuron copies from the pool."""
        return (self.active_gate_cols + self.up_cols + self.hidden) * self.dtype.itemsize

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            lib.pc_get_stats(self._handle, self._stats)
            s = self._stats
            return CacheStats(s.updates, s.paired_updates, s.rebuilds, s.rows_copied, s.bytes_moved)

    def check_valid(self) -> None:
        """Raise CacheInvariantError unless active_indices and index_to_position are a
        bijection, the mask equals the active set, and every active row equals its neuron's
        pool row (gate | up or up alone, and down_T)."""
        message = ffi.new("char[]", 512)
        with self._lock:
            rc = lib.pc_check_valid(self._handle, message, 512)
        if rc != lib.PC_OK:
            raise CacheInvariantError(ffi.string(message).decode())


def rows_mlp_split(
    x: torch.Tensor, g: torch.Tensor, idx: torch.Tensor, up: torch.Tensor, down_T: torch.Tensor
) -> torch.Tensor:
    """One token's in-place sparse MLP over rows held in two float32 arrays, in C:
    sum over k of g[k] * (x . up[idx[k]]) * down_T[idx[k]], as (hidden,).

    The same products, in the same order, as ``PairedCache.rows_mlp`` over a pool holding
    those rows: what a compressed pool's layer computes over the rows it decoded (idx
    0..m-1) or keeps decoded (idx the picked rows), with no gather.

    Args:
        x: (up_cols,) float32.
        g: (m,) float32, act(gate x) at the rows idx.
        idx: (m,) int32 row ids in [0, N).
        up: (N, up_cols) float32, row-major.
        down_T: (N, hidden) float32, row-major.

    Returns:
        (hidden,) float32.

    Raises:
        PairedCacheError: any other input (a row id out of range included), before
            anything is computed.
    """
    n = up.shape[0] if isinstance(up, torch.Tensor) and up.dim() == 2 else -1
    m = idx.shape[0] if isinstance(idx, torch.Tensor) and idx.dim() == 1 else -1
    up_cols = up.shape[1] if n >= 0 else -1
    hidden = down_T.shape[1] if isinstance(down_T, torch.Tensor) and down_T.dim() == 2 else -1
    for name, t, dtype, shape in (
        ("x", x, torch.float32, (up_cols,)),
        ("g", g, torch.float32, (m,)),
        ("idx", idx, torch.int32, (m,)),
        ("up", up, torch.float32, (n, up_cols)),
        ("down_T", down_T, torch.float32, (n, hidden)),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != "cpu":
            raise PairedCacheError(
                f"rows_mlp_split: {name} must be a CPU {dtype} tensor, got "
                f"{getattr(t, 'dtype', type(t).__name__)}"
            )
        if tuple(t.shape) != shape or min(shape) < 0:
            raise PairedCacheError(
                f"rows_mlp_split: {name} has shape {tuple(t.shape)}; expected x (up_cols,), "
                f"g and idx (m,), up (N, up_cols), down_T (N, hidden)"
            )
    x, g, idx = x.contiguous(), g.contiguous(), idx.contiguous()
    up, down_T = up.contiguous(), down_T.contiguous()
    out = torch.empty(hidden, dtype=torch.float32)
    rc = lib.pc_rows_mlp_split_f32(
        ffi.cast("float *", x.data_ptr()),
        ffi.cast("float *", g.data_ptr()),
        ffi.cast("int32_t *", idx.data_ptr()),
        m,
        ffi.cast("float *", up.data_ptr()),
        ffi.cast("float *", down_T.data_ptr()),
        n,
        up_cols,
        hidden,
        ffi.cast("float *", out.data_ptr()),
    )
    check_kernel_rc("rows_mlp_split", rc, n)
    return out


__all__ = [
    "SUPPORTED_DTYPES",
    "CacheInvariantError",
    "CacheStats",
    "PairedCache",
    "UpdateInfo",
    "core_info",
    "rows_mlp_split",
]
