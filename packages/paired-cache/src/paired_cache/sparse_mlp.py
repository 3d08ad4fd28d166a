"""SparseMLP: a gated MLP (SwiGLU, GeGLU) computed over its cached active rows only; and
sparsify_model, which puts a SparseMLP (gated) or a SparseFFN (non-gated) in place of
every MLP of a model."""

from __future__ import annotations

import functools
import types
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from paired_cache.cache import PairedCache
from paired_cache.config import PairedCacheConfig
from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import Activation, MaskSource, active_rows, mask_rows
from paired_cache.mlp_layouts import (
    GATED_MLP_PARTS,
    MLPLayout,
    activation,
    describe,
    gated_weights,
    linears,
    mlp_layout,
)
from paired_cache.pool_file import PoolFile, PoolLayer
from paired_cache.registry import make_source, source_class
from paired_cache.sparse_base import (
    SAVE_REFUSED,
    CachedMLP,
    check_not_offloaded,
    check_prefill,
    check_window,
)
from paired_cache.sparse_ffn import FFN_SOURCES, SparseFFN

# Fewer calibration tokens than this are refused: "lowrank" fits rank <= T (the default
# rank is 128) and "fixed" averages over T tokens, so a handful of tokens fits noise.
MIN_CALIBRATION_TOKENS = 16

# Where a token's rows are read from: "copy", the paired-replacement cache's packed active
# rows (anonymous memory, updated by the rows that change); "in_place", the (mapped) pool
# itself, each token's rows gathered into temporaries freed after the layer.
ROW_MODES = ("copy", "in_place")


class SparseMLP(CachedMLP):
    """down(act(gate x) * up x) over the rows a mask source picks for each token.

    The PairedCache holds the weights (pools) and the packed active rows; gate and up of
    one neuron sit side by side in one row, so one matmul over the (2m, hidden) view gives
    both. forward: x (..., hidden) float -> (..., hidden). With a full mask it equals the
    dense MLP up to float rounding.
    """

    def __init__(
        self,
        cache: PairedCache,
        act: Activation,
        source: MaskSource,
        window: int = 1,
        in_place: bool = False,
        prefill: str = "sparse",
        gate: torch.Tensor | None = None,
    ) -> None:
        """A gated MLP over a PairedCache's rows, picked by a mask source.

        Args:
            cache: the PairedCache holding the MLP's pools.
            act: the MLP's activation.
            source: the mask source, over the cache's N rows.
            window: tokens whose masks' union stays resident, in [1, 1024].
            in_place: read each token's rows from the pool, keeping none (window 1).
            prefill: how a forward of several tokens runs, see SparseMLP.prefill.
            gate: (N, up_cols) the gate weights, only for a cache whose pool holds none (a
                pool file converted with gate=False); the mask source must then compute
                act(gate x) itself, and a dense prefill multiplies by this gate.

        Raises:
            PairedCacheError: a source, window or gate that does not fit the cache.
        """
        super().__init__()
        check_prefill(prefill)
        if gate is not None and cache.gate_cols:
            raise PairedCacheError(
                "gate= is for a cache whose pool holds no gate; this one has gate_cols="
                f"{cache.gate_cols}"
            )
        gate_weight = cache.gate_pool if gate is None else gate
        if gate_weight is None or tuple(gate_weight.shape) != (cache.n_rows, cache.up_cols):
            got = "none" if gate_weight is None else tuple(gate_weight.shape)
            raise PairedCacheError(
                f"SparseMLP needs a gate of shape (N, up_cols) = ({cache.n_rows}, "
                f"{cache.up_cols}) in the cache's pool or as gate=, got {got}"
            )
        check_window(window)
        if in_place:
            check_in_place_window(window)
        need = 1 if in_place else window_capacity(source.k, cache.n_rows, window)
        if source.n_rows != cache.n_rows or need > cache.capacity:
            raise PairedCacheError(
                f"mask source picks {source.k} of {source.n_rows} rows over a window of "
                f"{window} tokens (up to {need} resident); the cache has N={cache.n_rows}, "
                f"capacity={cache.capacity}"
            )
        if not cache.gate_rows and not source.gives_gate:
            raise PairedCacheError(
                f"the cache keeps no gate rows (gate_rows=False) but mask source "
                f"{type(source).__name__} does not return act(gate x)"
            )
        if gate is not None and not source.gives_gate:
            raise PairedCacheError(
                f"the cache's pool holds no gate (converted with gate=False) but mask source "
                f"{type(source).__name__} does not return act(gate x): convert the pool with "
                f"its gate, or use a source that computes it (cats, the gated predictor)"
            )
        self.cache, self.act_fn, self.source, self.window = cache, act, source, window
        self.gate_weight = gate_weight  # (N, up_cols): the pool's gate block or the given gate
        self.in_place, self.prefill = in_place, prefill
        # Called before a dense prefill reads every row: from_pool_file sets it to ask
        # for the layer's whole pool at once.
        self._will_read_pool = None
        # In place: called with a token's picked rows (ascending indices) before they are
        # read; load_sparse's PageKeeper sets it to ask for their pages where the layer's
        # pool is not kept cached.
        self.will_read_rows = None
        self._recent: deque[torch.Tensor] = deque(maxlen=window)
        self.tokens = 0
        self.pool_rows_read = 0

    @property
    def pool_bytes_read(self) -> int:
        """Bytes copied from the neuron pool into the active rows since construction.

        Only copies out of the pool count: a rebuild reads every row of the new set, a paired
        update its added rows. The rows a shrinking set moves down into holes are copied
        within the active buffers (cache.stats.bytes_moved counts them too). In place, every
        token's rows count: each token gathers them from the pool."""
        return self.pool_rows_read * self.cache.active_row_bytes

    def _update(self, mask: torch.Tensor) -> None:
        info = self.cache.update(mask)
        self.pool_rows_read += info.rows_copied if info.rebuilt else info.added

    def _resident_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The union of the masks of the last window tokens, this one included."""
        self._recent.append(mask)
        if self.window == 1:
            return mask
        union = self._recent[0].clone()
        for m in list(self._recent)[1:]:
            union |= m
        return union

    @classmethod
    def from_mlp(
        cls,
        mlp: nn.Module,
        source: str,
        fraction: float,
        calibration: torch.Tensor | None = None,
        config: PairedCacheConfig | None = None,
        window: int = 1,
        prefill: str = "sparse",
        **options,
    ) -> SparseMLP:
        """Wrap a gated MLP, its weights copied into a PairedCache.

        Args:
            mlp: a gated MLP (gate_proj, up_proj, down_proj and act_fn, or Phi-3's fused
                gate_up_proj, down_proj and activation_fn), bias-free.
            source: a MASK_SOURCES name.
            fraction: the share of the rows each token reads, in (0, 1].
            calibration: (T, hidden) inputs of this MLP, for the sources that fit to data.
            config: the cache's PairedCacheConfig (None: its defaults).
            window: tokens whose masks' union stays resident (1: only the current
                token's rows), in [1, 1024].
            prefill: how a forward of several tokens runs, see SparseMLP.prefill.
            **options: the mask source's options.

        Returns:
            The SparseMLP.

        Raises:
            PairedCacheError: an MLP it cannot take, or a bad argument.
        """
        check_mlp(mlp)
        check_prefill(prefill)
        source_class(source)
        check_window(window)
        layout = mlp_layout(mlp)
        act = activation(mlp, layout)
        with torch.no_grad():
            gate, up, down = gated_weights(mlp, layout)
            n = gate.shape[0]
            capacity = window_capacity(active_rows(fraction, n), n, window)
            # A source that computes act(gate x) itself hands it over: no active gate rows.
            gate_rows = not source_class(source).gives_gate_for(**options)
            cache = PairedCache(
                up, down, gate, capacity=capacity, config=config, gate_rows=gate_rows
            )
            # The source reads the cache's pools: no second copy of gate and up.
            src = make_source(
                source, cache.gate_pool, cache.up_pool, act, fraction, calibration, **options
            )
        return cls(cache, act, src, window, prefill=prefill)

    @classmethod
    def from_pool_file(
        cls,
        pool_file,
        layer: int | str,
        act: Activation,
        source: str,
        fraction: float,
        *,
        config: PairedCacheConfig | None = None,
        window: int = 1,
        calibration: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
        rows: str = "copy",
        prefill: str = "sparse",
        **options,
    ) -> SparseMLP:
        """A SparseMLP over one layer of a PoolFile: the pool stays in the read-only file
        mapping and only the active rows (window_capacity rows) are anonymous memory.

        Args:
            pool_file: an uncompressed PoolFile (a compressed one's layers are
                compressed_mlp.CompressedSparseMLP's).
            layer: the layer, by name or index.
            act: the MLP's activation.
            source: a MASK_SOURCES name.
            fraction: the share of the rows each token reads, in (0, 1].
            config: the cache's PairedCacheConfig (None: its defaults).
            window: tokens whose masks' union stays resident, in [1, 1024].
            calibration: (T, hidden) inputs of this MLP, for the sources that fit to data.
            gate: (N, up_cols) of the pool's dtype, the gate the mask source scores with,
                e.g. gate_proj.weight mapped from the safetensors (load_sparse passes it):
                a bundled pool's gate block shares its pages with the up and down rows, a
                contiguous gate touches only its own. Required when the pool holds no
                gate (converted with gate=False); the source must then compute act(gate x).
            rows: "copy" (the paired-replacement cache: the active rows are anonymous
                copies, updated by the rows that change) or "in_place" (each token gathers
                its rows from the mapping into temporaries freed after the layer, so only
                the page cache holds them, which a hard limit can reclaim; window 1).
            prefill: how a forward of several tokens runs, see SparseMLP.prefill.
            **options: the mask source's options; a list or tuple gives one per layer.

        Returns:
            The SparseMLP.

        Raises:
            PairedCacheError: a bad argument, a compressed pool, or a gate that is missing
                or does not fit the layer.
        """
        source_class(source)
        check_window(window)
        check_prefill(prefill)
        check_rows(rows)
        index, spec = _uncompressed_layer(pool_file, layer)
        _check_pool_gate(pool_file, spec, gate)
        in_place = rows == "in_place"
        capacity = window_capacity(active_rows(fraction, spec.n_rows), spec.n_rows, window)
        if in_place:
            check_in_place_window(window)  # before the cache is made
            capacity = 1  # the active buffers stay empty
        options = _layer_options(options, index)
        # A gate-less pool has no gate for the active rows to leave out.
        gate_rows = spec.gate_cols == 0 or not source_class(source).gives_gate_for(**options)
        cache = PairedCache.from_pool_file(
            pool_file, index, capacity=capacity, config=config, gate_rows=gate_rows
        )
        scored = cache.gate_pool if gate is None else gate
        src = make_source(source, scored, cache.up_pool, act, fraction, calibration, **options)
        pool_gate = gate if spec.gate_cols == 0 else None  # the gate the pool lacks
        sparse = cls(cache, act, src, window, in_place=in_place, prefill=prefill, gate=pool_gate)
        if gate is not None:
            sparse.use_gate_proj(gate)
        sparse._will_read_pool = functools.partial(pool_file.will_need, index)
        return sparse

    def use_gate_proj(self, gate: torch.Tensor) -> None:
        """Expose gate ((N, hidden), e.g. gate_proj.weight mapped from the safetensors) as
        the bias-free nn.Linear child gate_proj, whose weight is gate itself (no copy).

        The mask source (when it computes act(gate x)) and a dense prefill then compute
        gate x by calling the child found under that name at forward time, so that another
        package may replace ``sparse_mlp.gate_proj`` by any module computing x @ W.T (a
        compressed linear) and have it used.

        Args:
            gate: (N, hidden) the gate projection's weight, in the pool's dtype.
        """
        with torch.device("meta"):  # no weight allocated: gate takes its place
            linear = nn.Linear(gate.shape[1], gate.shape[0], bias=False, dtype=gate.dtype)
        linear.weight = nn.Parameter(gate, requires_grad=False)
        self.gate_proj = linear
        if self.source.gives_gate:
            self.source.gate_product = self._gate_product

    def _gate_product(self, x: torch.Tensor) -> torch.Tensor:
        """x: (hidden,) -> (N,) gate x, through the gate_proj child this module holds now."""
        return self.gate_proj(x.to(self.weight_dtype))

    def _gate_x(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, N) gate x over every row: the gate_proj child's, if any."""
        if "gate_proj" in self._modules:
            return self.gate_proj(x)
        return F.linear(x, self.gate_weight)

    def _in_place_forward(
        self, x: torch.Tensor, idx: torch.Tensor, gate_at: torch.Tensor | None
    ) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over the rows idx ((m,) int32, ascending), read
        from the pool; gate_at: (m,) act(gate x) at those rows of the one token x, when the
        mask source computed it."""
        if self.will_read_rows is not None:
            self.will_read_rows(idx)
        self.pool_rows_read += idx.numel()
        if gate_at is not None and x.shape[0] == 1 and self.cache.dtype == torch.float32:
            # The C kernel: each picked row's up and down_T read once, where they lie.
            return self.cache.rows_mlp(x[0], gate_at, idx).unsqueeze(0)
        rows = idx.long()
        up = self.cache.up_pool.index_select(0, rows)  # (m, up_cols)
        if gate_at is None:
            g = self.act_fn(F.linear(x, self.cache.gate_pool.index_select(0, rows)))  # (T, m)
        else:
            g = gate_at  # (m,)
        h = g * F.linear(x, up)  # (T, m)
        return h @ self.cache.down_pool_T.index_select(0, rows)  # (T, m) @ (m, hidden)

    def _active_forward(
        self,
        x: torch.Tensor,
        keep: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over the m active rows; keep: (N,) bool, the rows
        this token's mask picked when the window keeps more rows resident; gate: (N,)
        act(gate x) of the one token x, when the mask source computed it (then only the up
        rows of the active set are read)."""
        m, hidden = self.cache.num_active, self.cache.gate_cols
        if gate is not None:
            # The mask source read every gate row already: take its values at the active
            # rows, and multiply x by the active up rows only (a strided view, no copy).
            h = gate[self.cache._indices[:m]] * F.linear(x, self.cache.up())  # (1, m)
        else:
            gate_up = self.cache.gate_up().view(2 * m, hidden)  # rows g_0, u_0, g_1, u_1, ...
            h2 = F.linear(x, gate_up).view(x.shape[0], m, 2)  # (T, m, 2)
            # The activation gets a contiguous copy of the gate column: on a strided input
            # torch takes its scalar loop, whose exp rounds differently from the vectorised
            # one that the dense MLP's contiguous gate output gets, and that last-bit
            # difference grows through the layers (1.6e-4 in SmolLM2's float32 logits).
            h = self.act_fn(h2[..., 0].contiguous()) * h2[..., 1]  # (T, m)
        if keep is not None:
            # Resident rows that this token's mask did not pick count as zero, so that the
            # window changes what is read from the pool, not what the MLP computes.
            h = h * keep[self.cache._indices[:m]].to(h.dtype)
        return F.linear(h, self.cache.down())  # down(): (hidden, m)

    def _rows_forward(
        self, x: torch.Tensor, mask: torch.Tensor, gate: torch.Tensor | None
    ) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over the rows of mask (N,) bool, for T tokens that
        share it; gate: (N,) act(gate x) when the mask source computed it (T == 1)."""
        if self.in_place:
            return self._in_place_forward(x, *mask_rows(mask, gate))
        self._update(self._resident_mask(mask))
        keep = mask if self.window > 1 else None
        return self._active_forward(x, keep, gate)

    @property
    def prefill(self) -> str:
        """How a forward of several tokens (a prompt) runs. "sparse" (the default): one
        mask per token, as in decoding, each token's rows only; what the quality benchmarks
        measure. "dense": every row at once, the dense MLP's product over the pool (a pool
        file's layer asked for in one read first), exact, and one matrix product instead of
        one per token; the rows of a long prompt's per-token masks cover nearly every row
        anyway. A forward of one token (decoding) is sparse either way."""
        return self._prefill

    @prefill.setter
    def prefill(self, mode: str) -> None:
        check_prefill(mode)
        self._prefill = mode

    def _dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden) over every row, read where it lies in the pool:
        gate, up and down from the pool's rows (they share pages, so the pool's gate block
        costs no read that up and down do not make), or the given gate when the pool holds
        none."""
        if self._will_read_pool is not None:
            self._will_read_pool()
        h = self.act_fn(self._gate_x(x)) * F.linear(x, self.cache.up_pool)
        if self.in_place:
            self.pool_rows_read += self.cache.n_rows
        return h @ self.cache.down_pool_T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP over each token's predicted-active rows (a multi-token input with
        ``prefill="dense"``: over every row).

        Args:
            x: (..., hidden) the MLP's input.

        Returns:
            (..., hidden) its output, in ``x``'s dtype.
        """
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(self.weight_dtype)  # (T, hidden)
        if flat.shape[0] > 1 and self._prefill == "dense":
            out = self._dense_forward(flat)
        elif not self.source.per_token:
            out = self._rows_forward(flat, self.source.select(flat[0]), None)
        elif self.in_place and flat.shape[0] == 1:  # decoding in place: no copy into out
            out = self._in_place_forward(flat, *self.source.select_rows(flat[0]))
        else:
            out = torch.empty_like(flat)
            # One mask per token, as in decoding: a prompt runs token by token here.
            for t in range(flat.shape[0]):
                if self.in_place:  # the picked rows' ids, no mask in between
                    idx, gate_at = self.source.select_rows(flat[t])
                    out[t] = self._in_place_forward(flat[t : t + 1], idx, gate_at)[0]
                    continue
                mask, gate = self.source.select_with_gate(flat[t])
                out[t] = self._rows_forward(flat[t : t + 1], mask, gate)[0]
        self.tokens += flat.shape[0]
        return out.view(shape).to(x.dtype)


def check_mlp(mlp: nn.Module, name: str = "") -> None:
    """Refuse, before anything is copied, an MLP that SparseMLP cannot take."""
    what = name or type(mlp).__name__
    if isinstance(mlp, CachedMLP):
        raise PairedCacheError(
            f"{what} is already a {type(mlp).__name__}: the model is already sparsified"
        )
    layout = mlp_layout(mlp)
    if layout is None or not layout.gated:
        raise PairedCacheError(f"{what} is not a gated MLP (needs {GATED_MLP_PARTS})")
    parts = linears(mlp, layout)
    if any(getattr(p, "bias", None) is not None for p in parts):
        raise PairedCacheError("SparseMLP supports bias-free projections only")
    check_not_offloaded(parts, what)


def window_capacity(k: int, n_rows: int, window: int) -> int:
    """Rows a window of `window` masks of k rows can keep resident: min(N, window * k)."""
    return min(n_rows, window * k)


def check_in_place_window(window: int) -> None:
    if window != 1:
        raise PairedCacheError(
            f"rows='in_place' reads each token's rows from the pool and keeps none resident: "
            f"window must be 1, got {window}"
        )


def check_rows(rows) -> None:
    """Refuse rows that are not one of ROW_MODES."""
    if rows not in ROW_MODES:
        raise PairedCacheError(f"rows must be one of {ROW_MODES}, got {rows!r}")


def _uncompressed_layer(pool_file: PoolFile, layer: int | str) -> tuple[int, PoolLayer]:
    """(index, spec) of layer in pool_file, which must be an uncompressed PoolFile."""
    if not isinstance(pool_file, PoolFile):
        raise PairedCacheError(f"pool_file must be a PoolFile, got {type(pool_file).__name__}")
    if pool_file.compressed:
        raise PairedCacheError(
            f"{pool_file.path} is a compressed pool: build its layers with "
            f"paired_cache.compressed_mlp.CompressedSparseMLP.from_pool_file (load_sparse "
            f"does)"
        )
    index = pool_file.resolve(layer)
    return index, pool_file.layers[index]


def _check_pool_gate(pool_file: PoolFile, spec: PoolLayer, gate) -> None:
    """Refuse a missing gate for a gate-less pool, and a given gate that is not a tensor of
    the layer's (N, gate_cols) and the pool's dtype."""
    gate_cols = spec.gate_cols or spec.up_cols  # a gate-less pool's gate is up-sized
    if gate is None and spec.gate_cols == 0:
        raise PairedCacheError(
            f"{spec.name}: the pool file holds no gate (converted with gate=False); pass "
            f"gate=, the ({spec.n_rows}, {spec.up_cols}) gate_proj weight (load_sparse maps "
            f"it from the model's safetensors)"
        )
    if gate is not None and (
        not isinstance(gate, torch.Tensor)
        or gate.shape != (spec.n_rows, gate_cols)
        or gate.dtype != pool_file.dtype
    ):
        got = (
            f"{tuple(gate.shape)} {gate.dtype}"
            if isinstance(gate, torch.Tensor)
            else type(gate).__name__
        )
        raise PairedCacheError(
            f"gate for {spec.name} must be a ({spec.n_rows}, {gate_cols}) "
            f"{pool_file.dtype} tensor, got {got}"
        )


def _layer_options(options: dict, index: int) -> dict:
    """Per-layer options: a value given as a list or tuple of one per layer is indexed."""
    return {k: (v[index] if isinstance(v, (list, tuple)) else v) for k, v in options.items()}


def collect_mlp_inputs(model: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each gated MLP's inputs when model runs on input_ids.

    Args:
        model: a dense model.
        input_ids: (B, T) integer token ids.

    Returns:
        {mlp name: its inputs (B*T, hidden)}.
    """
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        layout = mlp_layout(module)
        if layout is not None and layout.gated:

            def hook(_module, args, name=name):
                x = args[0]
                inputs[name] = x.detach().reshape(-1, x.shape[-1]).clone()

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def model_family(model: nn.Module) -> str:
    """The model's transformers model_type (e.g. 'gpt_neox'), else its class name."""
    return getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__


def find_mlps(model: nn.Module) -> list[tuple[str, MLPLayout]]:
    """The MLPs of model that a layout describes (gated or not).

    Args:
        model: any module.

    Returns:
        (name, layout) of each, in module order.
    """
    return [
        (name, layout)
        for name, module in model.named_modules()
        if (layout := mlp_layout(module)) is not None
    ]


def check_ffn(module: nn.Module, layout: MLPLayout, name: str, family: str, source: str) -> None:
    """Refuse, before anything is copied, a non-gated MLP that SparseFFN cannot take with
    this mask source."""
    if source not in FFN_SOURCES:
        # The first line names the family and what is missing; the second, what works.
        raise PairedCacheError(
            f"{family}: mask source {source!r} needs a gated MLP (act(gate x) * up x); "
            f"{name} is {describe(layout)}\na non-gated MLP takes {list(FFN_SOURCES)} "
            f"(CATS keeps the rows with the largest |act(fc1 x + b1)|)"
        )
    check_not_offloaded(linears(module, layout), name)


def _put_ffn(model: nn.Module, name: str, layout: MLPLayout, sparse: SparseFFN) -> None:
    """Replace a module that is only fc1, act and fc2 (PhiMLP, GPTNeoXMLP) by sparse; in a
    module that holds more (OPT's decoder layer), sparse takes fc1's place and computes the
    whole MLP, and act and fc2 become identities."""
    module = model.get_submodule(name)
    children = {child for child, _ in module.named_children()}
    if children <= set(layout.parts):
        _replace(model, name, sparse)
        return
    fc1, fc2, act = layout.parts
    setattr(module, fc1, sparse)
    setattr(module, act, nn.Identity())
    setattr(module, fc2, nn.Identity())


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def sparsify_model(
    model: nn.Module,
    source: str,
    fraction: float,
    calibration_ids: torch.Tensor | None = None,
    config: PairedCacheConfig | None = None,
    window: int = 1,
    prefill: str = "sparse",
    **options,
) -> list[SparseMLP | SparseFFN]:
    """Replace every MLP of model in place by a SparseMLP (gated: SwiGLU, GeGLU, Phi-3's
    fused gate_up_proj) or a SparseFFN (non-gated fc1 / fc2: GPT-NeoX, Phi-2, OPT).

    Every argument and every MLP is checked before the first one is replaced; a refusal
    names the model's family. The sparsified model cannot be saved with save_pretrained or
    state_dict (they raise: the weights live in the caches) nor moved to another dtype or
    device (raises); see SAVE_REFUSED for the package's own save path.

    Args:
        model: a dense transformers model (or any module holding MLPs a layout describes).
        source: a MASK_SOURCES name; a non-gated MLP takes "cats" only.
        fraction: the share of each MLP's rows a token reads, in (0, 1].
        calibration_ids: (1, T) or (T,) integer token ids, T >= MIN_CALIBRATION_TOKENS,
            whose MLP inputs fit the "lowrank" and "fixed" sources (required by them).
        config: the caches' PairedCacheConfig (None: its defaults).
        window: tokens whose masks' union stays resident, in [1, 1024]; 1 for a
            non-gated MLP.
        prefill: how a forward of several tokens runs, see SparseMLP.prefill.
        **options: the mask source's options; a list or tuple gives one value per MLP.

    Returns:
        The new modules, in the model's order.

    Raises:
        PairedCacheError: a bad argument, an already sparsified model, a model with no
            MLP paired-cache knows, or an MLP the source or window cannot take.
    """
    _check_not_sparsified(model)
    found = _checked_mlps(model, source, window, prefill)
    calibration = _calibration_inputs(model, source, calibration_ids)
    replaced: list[SparseMLP | SparseFFN] = []
    for name, layout in found:
        module = model.get_submodule(name)
        layer_options = _layer_options(options, len(replaced))
        if layout.gated:
            sparse = SparseMLP.from_mlp(
                module,
                source,
                fraction,
                calibration.get(name),
                config,
                window,
                prefill,
                **layer_options,
            )
            _replace(model, name, sparse)
        else:
            fc1, fc2 = linears(module, layout)
            act = activation(module, layout)
            sparse = SparseFFN.from_linears(
                fc1, fc2, act, source, fraction, config, prefill, **layer_options
            )
            _put_ffn(model, name, layout, sparse)
        replaced.append(sparse)
    guard_sparse_model(model)
    return replaced


def _check_not_sparsified(model: nn.Module) -> None:
    sparse_already = [name for name, m in model.named_modules() if isinstance(m, CachedMLP)]
    if sparse_already:
        raise PairedCacheError(
            f"{type(model).__name__} is already sparsified ({len(sparse_already)} "
            f"{type(model.get_submodule(sparse_already[0])).__name__} modules, e.g. "
            f"{sparse_already[0]}): sparsify a freshly loaded dense model to change the "
            f"source or fraction"
        )


def _checked_mlps(
    model: nn.Module, source: str, window: int, prefill: str
) -> list[tuple[str, MLPLayout]]:
    """find_mlps(model), once the source, window and prefill and every MLP are checked."""
    family = model_family(model)
    found = find_mlps(model)
    if not found:
        raise PairedCacheError(
            f"{family}: {type(model).__name__} has no MLP that paired-cache knows; it "
            f"sparsifies gated MLPs (modules with {GATED_MLP_PARTS}, or Phi-3's gate_up_proj, "
            f"down_proj and activation_fn) and non-gated ones (dense_h_to_4h, dense_4h_to_h "
            f"and act, as GPT-NeoX; fc1, fc2 and activation_fn, as Phi-2 and OPT)"
        )
    source_class(source)
    check_window(window)
    check_prefill(prefill)
    for name, layout in found:
        module = model.get_submodule(name)
        if layout.gated:
            check_mlp(module, name)
            continue
        check_ffn(module, layout, name, family, source)
        if window != 1:
            raise PairedCacheError(
                f"{family}: window={window} keeps several tokens' rows resident, which only "
                f"a gated MLP supports; {name} is {describe(layout)}: use window=1"
            )
    return found


def _calibration_inputs(model: nn.Module, source: str, ids) -> dict[str, torch.Tensor]:
    """Each gated MLP's inputs for the checked calibration ids ({} without ids), refused
    when the source needs them and none are given."""
    if ids is None:
        if source_class(source).needs_calibration:
            raise PairedCacheError(
                f"mask source {source!r} needs calibration_ids: (1, T) token ids, "
                f"T >= {MIN_CALIBRATION_TOKENS}"
            )
        return {}
    return collect_mlp_inputs(model, _check_calibration_ids(ids))


def _check_calibration_ids(ids) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise PairedCacheError(
            f"calibration_ids must be an integer tensor of token ids, (1, T) or (T,), got "
            f"{type(ids).__name__}{'' if not isinstance(ids, torch.Tensor) else ' ' + str(ids.dtype)}"
        )
    if ids.dim() == 1:  # one sequence, as a tokenizer's input_ids[0]
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise PairedCacheError(
            f"calibration_ids must be (1, T) or (T,) token ids, got shape {tuple(ids.shape)}"
        )
    if ids.numel() < MIN_CALIBRATION_TOKENS:
        raise PairedCacheError(
            f"calibration_ids hold {ids.numel()} tokens; at least {MIN_CALIBRATION_TOKENS} "
            f"are needed (a few hundred fit better)"
        )
    return ids


def _refuse_save_pretrained(self, *args, **kwargs):
    raise PairedCacheError(f"save_pretrained: {SAVE_REFUSED}")


def _checked_apply(self, fn, recurse: bool = True):
    # Every SparseMLP checks fn before any module is converted, so a refused .to() leaves
    # the whole model as it was (Module._apply would convert the modules before the first
    # SparseMLP, then raise).
    for module in self.modules():
        if isinstance(module, CachedMLP):
            module.check_move(fn)
    return type(self)._apply(self, fn, recurse)


def guard_sparse_model(model: nn.Module) -> None:
    """Make model.save_pretrained refuse before it writes anything, and model.to() /
    .half() / ... check every SparseMLP before converting any module."""
    if isinstance(model, CachedMLP):
        return
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = types.MethodType(_refuse_save_pretrained, model)
    model._apply = types.MethodType(_checked_apply, model)
