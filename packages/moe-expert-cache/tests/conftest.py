"""Tiny random MoE checkpoints built from mlx_lm.models, shared by the whole session."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from membound_testing.random_moe import random_moe_config, write_random_moe
from moe_expert_cache import seal_model

PROMPT = [3, 17, 42, 99, 7, 250, 31, 64]
DECODE_STEPS = 16


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch, bits) -> a saved 2-layer, 8-expert, top-2 model with 2 shards."""
    made = {}

    def get(arch: str, bits: int | None = None):
        if (arch, bits) not in made:
            path = tmp_path_factory.mktemp(f"{arch}_{bits}")
            made[arch, bits] = write_random_moe(
                path, random_moe_config(arch), bits=bits, seal=seal_model
            )
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
    """The MoEfied SmolLM2-135M (membound_testing.moefy), built once under membound's cache
    directory; the first session builds it (minutes), later ones find it."""
    from membound_testing.models import cache_dir, smollm2_float_dir
    from membound_testing.moefy import moefy_cached

    return moefy_cached(smollm2_float_dir(), cache_dir(), progress=False, seal=seal_model)


@pytest.fixture(scope="session")
def real_shared_moe():
    """The demo's MoEfied SmolLM2-135M (``membound_testing.moefy.demo_config``: a Qwen2-MoE,
    a shared expert of 1,152 neurons and 128 routed experts of 3, top-48), built once under
    membound's cache directory like ``real_moe``."""
    from membound_testing.models import cache_dir, smollm2_float_dir
    from membound_testing.moefy import demo_config, moefy_cached

    return moefy_cached(
        smollm2_float_dir(), cache_dir(), demo_config(), progress=False, seal=seal_model
    )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random 2-layer float32 Llama checkpoint (64 MLP neurons), the kind of input moefy
    takes."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    cfg = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    directory = tmp_path_factory.mktemp("tiny-llama")
    mx.save_safetensors(
        str(directory / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory
