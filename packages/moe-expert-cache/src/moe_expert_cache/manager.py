"""The model-wide cache: between-token updates, metrics, and the saved cache state."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from moe_expert_cache.checked_json import dumps_checksummed, is_int, loads_checksummed, write_atomic
from moe_expert_cache.config import ExpertCacheConfig
from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.layer_cache import LayerCache, LayerMetrics
from moe_expert_cache.trace import RouterTrace

if TYPE_CHECKING:
    from moe_expert_cache.prefetch import SpeculativePrefetch

STATE_FORMAT, STATE_VERSION = "moe-expert-cache-state", 2
STATE_KEYS = ("num_experts", "pinned", "resident", "top_k")


class ExpertCacheManager:
    """All MoE layers' caches of one model, in layer order.

    The patched model calls :meth:`begin_forward` at the start of every forward, so the
    between-token update runs under any generation loop (``mlx_lm.generate``,
    ``stream_generate``, your own); :meth:`metrics`, :meth:`state` and :attr:`trace` fold in
    the last forward first.
    """

    def __init__(
        self,
        layers: list[LayerCache],
        config: ExpertCacheConfig,
        top_k: int,
        vocab_size: int | None = None,
        prefetch: SpeculativePrefetch | None = None,
    ):
        self.layers, self.config, self.top_k = layers, config, top_k
        self.vocab_size = vocab_size
        self.prefetch = prefetch  # the speculative prefetch, when config.prefetch
        self._trace: RouterTrace | None = None

    @property
    def trace(self) -> RouterTrace | None:
        """The trace started by :meth:`start_trace`, up to the last forward."""
        self.dynamic_cache_update()
        return self._trace

    def start_trace(self) -> RouterTrace:
        """Record every router choice from the next forward on into a new trace."""
        self.dynamic_cache_update()
        self._trace = RouterTrace(len(self.layers), self.layers[0].slots.num_experts, self.top_k)
        return self._trace

    def begin_forward(self, inputs: mx.array | None) -> None:
        """Called by the patched model before each forward: check the token ids ``inputs``
        (B, L) int against the vocabulary, then run the pending between-token update.

        An id outside the embedding table is an out-of-bounds read inside MLX (a segfault),
        so it is refused here, before the model reads it. Reading the ids synchronises;
        the update reads the previous forward's router choices, which synchronises anyway.
        """
        if inputs is not None:
            check_token_ids(inputs, self.vocab_size)
        self.dynamic_cache_update()

    def dynamic_cache_update(self) -> int:
        """Between tokens: fold the buffered router choices into the statistics and, in
        skip mode, swap in the experts that missed, within the swap budget. The patched
        model runs it at the start of every forward; calling it earlier (as
        :func:`moe_expert_cache.generate` does after each token) does the same update, and
        with nothing buffered it does nothing.

        Layers with the most distinct misses are served first when ``max_layer_updates``
        limits how many layers may swap. Returns the number of experts loaded.
        """
        plans = []
        for layer in self.layers:
            counts = layer.consume(self._trace)
            if not layer.skip:
                continue  # exact mode already loaded every miss before computing
            wanted = [e for e, _ in counts.most_common() if not layer.slots.is_resident(e)]
            if wanted:
                plans.append((layer, wanted, counts))
        plans.sort(key=lambda p: -len(p[1]))
        if self.config.max_layer_updates is not None:
            plans = plans[: self.config.max_layer_updates]
        loaded = 0
        for layer, wanted, counts in plans:
            swaps = layer.slots.plan(
                wanted, counts, layer.policy, layer.tokens_seen, self.config.max_swaps_per_layer
            )
            layer.swap_in(swaps)
            loaded += len(swaps)
        return loaded

    def metrics(self) -> list[LayerMetrics]:
        """One :class:`LayerMetrics` per MoE layer, up to the last forward."""
        self.dynamic_cache_update()
        return [layer.metrics for layer in self.layers]

    def total_metrics(self) -> LayerMetrics:
        total = LayerMetrics()
        for m in self.metrics():
            for name in (f.name for f in fields(LayerMetrics)):
                setattr(total, name, getattr(total, name) + getattr(m, name))
        return total

    def resident_expert_bytes(self) -> int:
        return sum(layer.slots.capacity * layer.expert_nbytes for layer in self.layers)

    def all_expert_bytes(self) -> int:
        return sum(layer.slots.num_experts * layer.expert_nbytes for layer in self.layers)

    def state(self) -> dict:
        """Which experts are resident (slot order) and pinned, per MoE layer, and the
        model's experts per layer and top-k they apply to (after the pending update)."""
        self.dynamic_cache_update()
        return {
            "num_experts": [layer.slots.num_experts for layer in self.layers],
            "top_k": self.top_k,
            "resident": [[int(e) for e in layer.slots.slot_to_expert] for layer in self.layers],
            "pinned": [sorted(layer.slots.pinned) for layer in self.layers],
        }

    def save_state(self, path: str | Path) -> None:
        """Write :meth:`state` to ``path``: JSON with format and version, under a SHA-256
        of the whole file."""
        doc = {"format": STATE_FORMAT, "version": STATE_VERSION, "state": self.state()}
        write_atomic(path, dumps_checksummed(doc))


def check_token_ids(ids: mx.array, vocab_size: int | None) -> None:
    """Refuse token ids ``ids`` (any shape) that are not integers in ``[0, vocab_size)``."""
    if not mx.issubdtype(ids.dtype, mx.integer):
        raise ExpertCacheError(f"token ids must be an integer array, got {ids.dtype}")
    if vocab_size is None or ids.size == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any().item():
        values = np.array(ids).ravel()[np.array(bad).ravel()]
        raise ExpertCacheError(
            f"token ids must be in [0, vocab_size={vocab_size}), got {values[:5].tolist()}"
        )


def read_state(path: str | Path) -> dict:
    """Read a cache state saved by :meth:`ExpertCacheManager.save_state`, verified and
    validated: every expert id an integer in range, residents distinct and within
    capacity, pinned experts resident and leaving ``top_k`` free slots.

    Args:
        path: The state file.

    Returns:
        The state: ``num_experts``, ``top_k``, ``resident`` and ``pinned`` (one list of
        expert ids per MoE layer); pass it to :func:`config_from_state`.

    Raises:
        ExpertCacheError: A checksum mismatch, another format or version, or a state
            that does not hold together, naming the field and MoE layer.
    """
    doc = loads_checksummed(Path(path).read_bytes(), str(path))
    if doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
        raise ExpertCacheError(
            f"{path}: not a {STATE_FORMAT} v{STATE_VERSION} file "
            f"(format {doc.get('format')!r}, version {doc.get('version')!r})"
        )
    state = doc.get("state")
    if not isinstance(state, dict) or sorted(state) != sorted(STATE_KEYS):
        raise ExpertCacheError(f"{path}: state must hold exactly {list(STATE_KEYS)}")
    sizes, top_k = state["num_experts"], state["top_k"]
    if not isinstance(sizes, list) or not sizes or not all(is_int(e) and e >= 1 for e in sizes):
        raise ExpertCacheError(f"{path}: num_experts {sizes!r}, expected a list of ints >= 1")
    if not is_int(top_k) or not 1 <= top_k <= min(sizes):
        raise ExpertCacheError(f"{path}: top_k {top_k!r}, expected an int in [1, {min(sizes)}]")
    for name in ("resident", "pinned"):
        lists = state[name]
        if not isinstance(lists, list) or len(lists) != len(sizes):
            raise ExpertCacheError(f"{path}: {name} must hold one list per MoE layer")
        for layer, (experts, size) in enumerate(zip(lists, sizes, strict=True)):
            if not isinstance(experts, list) or not all(
                is_int(e) and 0 <= e < size for e in experts
            ):
                raise ExpertCacheError(
                    f"{path}: {name} experts of MoE layer {layer} are {experts!r}, expected "
                    f"integer expert ids in [0, {size})"
                )
            if len(set(experts)) != len(experts):
                raise ExpertCacheError(f"{path}: MoE layer {layer} repeats a {name} expert")
    for layer, (resident, pinned) in enumerate(
        zip(state["resident"], state["pinned"], strict=True)
    ):
        if not top_k <= len(resident) <= sizes[layer]:
            raise ExpertCacheError(
                f"{path}: MoE layer {layer} has {len(resident)} resident experts, expected "
                f"between top_k={top_k} and num_experts={sizes[layer]}"
            )
        if not set(pinned) <= set(resident) or len(pinned) > len(resident) - top_k:
            raise ExpertCacheError(
                f"{path}: pinned experts {pinned} of MoE layer {layer} must be resident and "
                f"leave top_k={top_k} of the {len(resident)} slots free"
            )
    return state


def config_from_state(config: ExpertCacheConfig, state: dict) -> ExpertCacheConfig:
    """``config`` warm-started from a saved state.

    Args:
        config: The settings to keep (mode, policy, prefetch, ...).
        state: A state from :func:`read_state`.

    Returns:
        A copy of ``config`` with the state's capacities, residents and pins; the model it
        loads must have the state's experts per layer and top-k.
    """
    return replace(
        config,
        capacity=[len(r) for r in state["resident"]],
        capacity_share=None,
        pinned=dict(enumerate(state["pinned"])),
        initial=dict(enumerate(state["resident"])),
        num_experts=state["num_experts"],
        top_k=state["top_k"],
    )
