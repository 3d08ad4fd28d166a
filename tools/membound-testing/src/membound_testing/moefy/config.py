"""What a MoEfication build takes: its settings (:class:`MoefyConfig`), the dense model's
``config.json`` (:func:`dense_config`) and the layout of experts they give together with
the calibration tokens (:class:`BuildPlan`). Each refuses what does not fit with a
:class:`MoefyError` naming the setting, before anything is read or written."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class MoefyError(ValueError):
    """A setting, dense checkpoint or calibration that moefy refuses; the message names the
    parameter (or file) and what was expected. A ``ValueError``."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class MoefyConfig:
    """``num_experts`` equal experts per layer, ``top_k`` chosen per token, and a shared
    expert of ``shared_size`` neurons (0: none, a Mixtral; else a Qwen2-MoE); k-means
    ``kmeans_iters`` rounds from a ``seed``; ridge ``ridge`` (relative to the mean diagonal
    of the Gram matrix); the router written scaled by ``router_scale``; calibration run in
    sequences of ``sequence_length`` tokens; ``shards`` safetensors files."""

    num_experts: int = 16
    top_k: int = 4
    shared_size: int = 0
    kmeans_iters: int = 10
    ridge: float = 1e-3
    router_scale: float = 1e-2
    sequence_length: int = 512
    shards: int = 4
    seed: int = 0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "kmeans_iters", "sequence_length", "shards"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise MoefyError(f"{name} must be an integer >= 1, got {v!r}")
        v = self.shared_size
        if not _is_int(v) or v < 0:
            raise MoefyError(f"shared_size must be an integer >= 0, got {v!r}")
        if self.top_k > self.num_experts:
            raise MoefyError(
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        for name in ("ridge", "router_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise MoefyError(f"{name} must be a number in (0, 1e6), got {v!r}")


def demo_config() -> MoefyConfig:
    """The layout of membound's demo MoE (#57): a Qwen2-MoE whose shared expert holds the
    1,152 neurons of largest mean mass (three quarters of SmolLM2's 1,536), the other 384 in
    128 routed experts of 3, top-48 (37.5% of the routed neurons per token, 1,296 of 1,536
    neurons in all).

    A dense SwiGLU MLP spreads its activation mass over most neurons for every token, and a
    linear router (the only kind the stock formats have) finds the heavy experts only in
    part. Measured on SmolLM2-135M (``benchmarks/moefy_sweep.py``), the MoE stays within 1.3x
    the dense model's perplexity on the held-out texts only with about two thirds of each MLP
    shared and small experts; with a shared expert of 256 it was 1.8-6.9x.

    Returns:
        A new :class:`MoefyConfig`.
    """
    return MoefyConfig(num_experts=128, shared_size=1152, top_k=48)


def dense_config(dense_dir: str | Path) -> dict:
    """The dense Llama's ``config.json``, checked.

    ``rope_theta`` is taken from transformers 5's ``rope_parameters`` when that is where it
    is (mlx-lm's Llama reads only ``rope_theta`` and would fall back to 10000).

    Args:
        dense_dir: A float Llama checkpoint directory.

    Returns:
        The config as a dict, with ``rope_theta`` at the top level.

    Raises:
        MoefyError: Not a Llama, not a SwiGLU MLP without biases, or no default RoPE base.
    """
    path = Path(dense_dir) / "config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") != "llama":
        raise MoefyError(f"{path}: model_type {cfg.get('model_type')!r}, expected 'llama'")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias") or cfg.get("attention_bias"):
        raise MoefyError(f"{path}: expected a SwiGLU MLP (silu) without biases")
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        if rope.get("rope_type", "default") != "default":
            raise MoefyError(f"{path}: rope_type {rope['rope_type']!r} is not supported")
        cfg["rope_theta"] = rope["rope_theta"]
    if "rope_theta" not in cfg:
        raise MoefyError(f"{path}: no rope_theta")
    return cfg


@dataclass(eq=False)
class BuildPlan:
    """``config`` applied to the dense model whose ``config.json`` is ``source``, calibrated
    on ``calibration_ids``: checked on construction (the shared expert fits, the experts
    divide the routed neurons, the ids are token ids, the head size is the one Mixtral and
    Qwen2-MoE derive)."""

    config: MoefyConfig
    source: dict
    calibration_ids: Sequence[int]
    ids: np.ndarray = field(init=False)  # (T,) int64

    def __post_init__(self):
        config, cfg = self.config, self.source
        n_neurons, shared = cfg["intermediate_size"], config.shared_size
        if shared >= n_neurons:
            raise MoefyError(
                f"shared_size must be in [0, intermediate_size={n_neurons}), got {shared}"
            )
        if (n_neurons - shared) % config.num_experts:
            raise MoefyError(
                f"num_experts must divide intermediate_size - shared_size = "
                f"{n_neurons - shared}, got {config.num_experts}"
            )
        ids = np.asarray(self.calibration_ids, dtype=np.int64)
        if (
            ids.ndim != 1
            or len(ids) < 2 * config.num_experts
            or not ((ids >= 0).all() and (ids < cfg["vocab_size"]).all())
        ):
            raise MoefyError(
                f"calibration_ids must be >= {2 * config.num_experts} token ids in "
                f"[0, {cfg['vocab_size']})"
            )
        if (
            "head_dim" in cfg
            and cfg["hidden_size"] // cfg["num_attention_heads"] != cfg["head_dim"]
        ):
            raise MoefyError(
                "Mixtral and Qwen2-MoE derive head_dim = hidden_size / heads; this model differs"
            )
        self.ids = ids

    @property
    def n_neurons(self) -> int:
        return self.source["intermediate_size"]

    @property
    def n_layers(self) -> int:
        return self.source["num_hidden_layers"]

    @property
    def expert_size(self) -> int:
        """Neurons per routed expert."""
        return (self.n_neurons - self.config.shared_size) // self.config.num_experts

    def chunks(self) -> list[np.ndarray]:
        """The calibration ids in sequences of ``sequence_length`` (a last one of a single
        token dropped)."""
        L, ids = self.config.sequence_length, self.ids
        return [ids[i : i + L] for i in range(0, len(ids), L) if len(ids[i : i + L]) > 1]

    def moe_config(self) -> dict:
        """The MoE checkpoint's ``config.json``: a Qwen2-MoE with a shared expert, else a
        Mixtral."""
        cfg, config = self.source, self.config
        out = {
            "vocab_size": cfg["vocab_size"],
            "hidden_size": cfg["hidden_size"],
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": cfg["num_attention_heads"],
            "num_key_value_heads": cfg["num_key_value_heads"],
            "num_experts_per_tok": config.top_k,
            "rms_norm_eps": cfg["rms_norm_eps"],
            "rope_theta": cfg["rope_theta"],
            "max_position_embeddings": cfg.get("max_position_embeddings", 8192),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_id": cfg.get("eos_token_id"),
            "torch_dtype": "float32",
        }
        if config.shared_size:
            out.update(
                model_type="qwen2_moe",
                architectures=["Qwen2MoeForCausalLM"],
                intermediate_size=self.n_neurons,  # unused by a model whose every layer is sparse
                moe_intermediate_size=self.expert_size,
                shared_expert_intermediate_size=config.shared_size,
                num_experts=config.num_experts,
                tie_word_embeddings=False,  # the lm_head is written out
            )
        else:
            out.update(
                model_type="mixtral",
                architectures=["MixtralForCausalLM"],
                intermediate_size=self.expert_size,
                num_local_experts=config.num_experts,
            )
        return out
