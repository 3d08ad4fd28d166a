"""Swap budgets and the device tables of the live cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from conftest import PROMPT
from mlx_lm.models.cache import make_prompt_cache

from moe_expert_cache import ExpertCacheConfig, load_cached_model


def test_skip_mode_swaps_within_budget_and_tables_follow(model_dir):
    cached = load_cached_model(
        model_dir("qwen2_moe", 4),
        ExpertCacheConfig(capacity=3, mode="skip", max_layer_updates=1, max_swaps_per_layer=1),
    )
    kv = make_prompt_cache(cached.model)
    y = mx.array([PROMPT])
    loaded = []
    for _ in range(12):
        logits = cached.model(y, cache=kv)
        y = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(y)
        before = [layer.metrics.swaps for layer in cached.manager.layers]
        loaded.append(cached.manager.dynamic_cache_update())
        changed = [
            layer.metrics.swaps - b for layer, b in zip(cached.manager.layers, before, strict=True)
        ]
        assert sum(c > 0 for c in changed) <= 1  # max_layer_updates
        assert max(changed) <= 1  # max_swaps_per_layer
        for layer in cached.manager.layers:
            e2s = layer.slots.expert_to_slot
            assert np.array_equal(np.array(layer.hit_mask), e2s >= 0)
            resident = e2s >= 0
            assert np.array_equal(np.array(layer.lookup)[resident], e2s[resident])
    assert sum(loaded) > 0
    assert cached.manager.total_metrics().skipped > 0
