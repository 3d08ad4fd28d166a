"""MoEfication (Zhang et al., 2022): a dense Llama model's MLPs split into an mlx-lm MoE.

Each layer's ``intermediate_size`` SwiGLU neurons are clustered into ``num_experts`` equal
groups of neurons that fire together on calibration text (balanced spherical k-means on
each neuron's activation mass over the calibration tokens), and a linear router per layer
is fitted by ridge regression from the MLP input to each expert's share of the activation
mass. Optionally the ``shared_size`` neurons of the largest mean mass first go to a shared
expert that every token runs (a SwiGLU MLP spends its mass on many neurons for every token:
those are not a choice). Llama's attention, GQA, RoPE base and embeddings are kept.

Without a shared expert the checkpoint is a Mixtral (mlx-lm's stacked ``switch_mlp``
layout); with one it is a Qwen2-MoE, the mlx-lm format that has a shared expert (its
q/k/v biases are written as zeros and its ``lm_head`` as the tied embedding).

MoEfication sums the chosen experts with weight 1, while both formats weight them by a
softmax of their router logits (Mixtral: over the top-k; Qwen2-MoE: over all experts, not
renormalised). The router is therefore written scaled by ``router_scale`` (its logits
differ by ~1e-3, so the softmax is uniform to ~1e-3) and every expert's ``down_proj``
multiplied by the inverse of that uniform weight (``top_k``, or ``num_experts``); the
shared expert's gate is a zero vector (sigmoid 1/2) and its ``down_proj`` doubled. The
checkpoint computes the plain sum over the chosen experts (and the shared one), and with
every expert chosen it is the dense model. The expert *choice* is the fitted router's,
unchanged by the scale.

Dev-only (#56: test-model builders leave the runtime wheels). It was
``moe_expert_cache.moefy`` through moe-expert-cache 0.9.0. It imports no package of the repo: the caller
passes moe-expert-cache's ``seal_model`` as ``seal``. Needs the ``moefy`` extra (MLX,
mlx-lm, numpy, tqdm)::

    from membound_testing.moefy import MoefyConfig, moefy_cached
    from moe_expert_cache import seal_model

    moe_dir = moefy_cached("smollm2-f32", "moe-cache", MoefyConfig(), seal=seal_model)
"""

from membound_testing.moefy.build import (
    BUILD_RECORD,
    build_key,
    load_dense,
    moefy,
    moefy_cached,
)
from membound_testing.moefy.calibration import calibration_text
from membound_testing.moefy.config import MoefyConfig, MoefyError, demo_config, dense_config

__all__ = [
    "BUILD_RECORD",
    "MoefyConfig",
    "MoefyError",
    "build_key",
    "calibration_text",
    "demo_config",
    "dense_config",
    "load_dense",
    "moefy",
    "moefy_cached",
]
