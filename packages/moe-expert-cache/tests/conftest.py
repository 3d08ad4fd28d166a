"""Tiny random MoE checkpoints built from mlx_lm.models, shared by the whole session."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from moe_expert_cache.random_model import random_moe_config, write_random_moe

PROMPT = [3, 17, 42, 99, 7, 250, 31, 64]
DECODE_STEPS = 16


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch, bits) -> a saved 2-layer, 8-expert, top-2 model with 2 shards."""
    made = {}

    def get(arch: str, bits: int | None = None):
        if (arch, bits) not in made:
            path = tmp_path_factory.mktemp(f"{arch}_{bits}")
            made[arch, bits] = write_random_moe(path, random_moe_config(arch), bits=bits)
        return made[arch, bits]

    return get


def decode_logits(model, tokens: list[int], manager=None) -> list[np.ndarray]:
    """Teacher-forced logits: the prompt, then one step per token of ``tokens[len(PROMPT):]``.

    Returns float32 (vocab,) per step; the manager (if any) updates between steps.
    """
    kv = make_prompt_cache(model)
    out = []
    logits = model(mx.array(tokens[: len(PROMPT)])[None], cache=kv)
    out.append(np.array(logits[0, -1].astype(mx.float32)))
    if manager is not None:
        manager.dynamic_cache_update()
    for t in tokens[len(PROMPT) :]:
        logits = model(mx.array([[t]]), cache=kv)
        out.append(np.array(logits[0, -1].astype(mx.float32)))
        if manager is not None:
            manager.dynamic_cache_update()
    return out


@pytest.fixture(scope="session")
def stock_run(model_dir):
    """stock_run(arch, bits) -> (tokens: prompt + greedy continuation, stock logits)."""
    runs = {}

    def get(arch: str, bits: int | None = None):
        if (arch, bits) not in runs:
            model, _ = load_model(model_dir(arch, bits))
            kv = make_prompt_cache(model)
            tokens = list(PROMPT)
            logits = model(mx.array(tokens)[None], cache=kv)
            for _ in range(DECODE_STEPS):
                tokens.append(int(mx.argmax(logits[0, -1]).item()))
                logits = model(mx.array([[tokens[-1]]]), cache=kv)
            runs[arch, bits] = (tokens, decode_logits(model, tokens), model)
        return runs[arch, bits]

    return get


@pytest.fixture(scope="session")
def real_moe():
    """The MoEfied SmolLM2-135M (moe_expert_cache.moefy), built once under membound's cache
    directory; the first session builds it (minutes), later ones find it."""
    from membound_testing.models import cache_dir, smollm2_float_dir
    from moe_expert_cache.moefy import moefy_cached

    return moefy_cached(smollm2_float_dir(), cache_dir(), progress=False)
