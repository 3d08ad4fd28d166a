"""The model-wide cache: between-token updates, metrics, and the saved cache state."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from moe_expert_cache.config import CacheConfig
from moe_expert_cache.layer_cache import LayerCache, LayerMetrics
from moe_expert_cache.trace import RouterTrace

STATE_FORMAT, STATE_VERSION = "moe-expert-cache-state", 1


class ExpertCacheManager:
    """All MoE layers' caches of one model, in layer order."""

    def __init__(self, layers: list[LayerCache], config: CacheConfig, top_k: int):
        self.layers, self.config, self.top_k = layers, config, top_k
        self.trace: RouterTrace | None = None

    def start_trace(self) -> RouterTrace:
        """Record every consumed router choice from now on into a new trace."""
        self.trace = RouterTrace(len(self.layers), self.layers[0].slots.num_experts, self.top_k)
        return self.trace

    def dynamic_cache_update(self) -> int:
        """Between tokens: fold the buffered router choices into the statistics and, in
        skip mode, swap in the experts that missed, within the swap budget.

        Layers with the most distinct misses are served first when ``max_layer_updates``
        limits how many layers may swap. Returns the number of experts loaded.
        """
        plans = []
        for layer in self.layers:
            counts = layer.consume(self.trace)
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
        return [layer.metrics for layer in self.layers]

    def total_metrics(self) -> LayerMetrics:
        total = LayerMetrics()
        for m in self.metrics():
            for name in ("requests", "hits", "misses", "fallbacks", "swaps", "bytes_read"):
                setattr(total, name, getattr(total, name) + getattr(m, name))
        return total

    def resident_expert_bytes(self) -> int:
        return sum(layer.slots.capacity * layer.expert_nbytes for layer in self.layers)

    def all_expert_bytes(self) -> int:
        return sum(layer.slots.num_experts * layer.expert_nbytes for layer in self.layers)

    def state(self) -> dict:
        """Which experts are resident (slot order) and pinned, per MoE layer."""
        return {
            "resident": [[int(e) for e in layer.slots.slot_to_expert] for layer in self.layers],
            "pinned": [sorted(layer.slots.pinned) for layer in self.layers],
        }

    def save_state(self, path: str | Path) -> None:
        """Write :meth:`state` to ``path`` (JSON with format, version and SHA-256)."""
        path = Path(path)
        body = json.dumps(self.state(), sort_keys=True)
        doc = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "sha256": hashlib.sha256(body.encode()).hexdigest(),
            "state": json.loads(body),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)


def read_state(path: str | Path) -> dict:
    """A state saved by :meth:`ExpertCacheManager.save_state`, validated."""
    doc = json.loads(Path(path).read_text())
    if doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
        raise ValueError(
            f"{path}: not a {STATE_FORMAT} v{STATE_VERSION} file "
            f"(format {doc.get('format')!r}, version {doc.get('version')!r})"
        )
    body = json.dumps(doc["state"], sort_keys=True)
    if hashlib.sha256(body.encode()).hexdigest() != doc["sha256"]:
        raise ValueError(f"{path}: checksum mismatch (corrupted cache state)")
    return doc["state"]


def config_from_state(config: CacheConfig, state: dict) -> CacheConfig:
    """``config`` warm-started from ``state``: same capacities, residents and pins."""
    return CacheConfig(
        capacity=[len(r) for r in state["resident"]],
        mode=config.mode,
        policy=config.policy,
        pinned=dict(enumerate(state["pinned"])),
        initial=dict(enumerate(state["resident"])),
        max_layer_updates=config.max_layer_updates,
        max_swaps_per_layer=config.max_swaps_per_layer,
    )
