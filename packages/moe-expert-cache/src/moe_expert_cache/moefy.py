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
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from moe_expert_cache.__about__ import __version__
from moe_expert_cache.checked_json import umask_mode
from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.expert_store import seal_model

BUILD_RECORD = "moefy.json"
BUILD_FORMAT = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class MoefyConfig:
    """``num_experts`` equal experts per layer, ``top_k`` chosen per token, and a shared
    expert of ``shared_size`` neurons (0: none, a Mixtral; else a Qwen2-MoE); k-means
    ``kmeans_iters`` rounds from a ``seed``; ridge ``ridge`` (relative to the mean diagonal
    of the Gram matrix); calibration run in sequences of ``sequence_length`` tokens;
    ``shards`` safetensors files."""

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
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ExpertCacheError(f"{name} must be an integer >= 1, got {v!r}")
        v = self.shared_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ExpertCacheError(f"shared_size must be an integer >= 0, got {v!r}")
        if self.top_k > self.num_experts:
            raise ExpertCacheError(
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        for name in ("ridge", "router_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise ExpertCacheError(f"{name} must be a number in (0, 1e6), got {v!r}")


def dense_config(dense_dir: Path) -> dict:
    """The dense Llama ``config.json``, checked; ``rope_theta`` taken from transformers 5's
    ``rope_parameters`` when that is where it is (mlx-lm's Llama reads only ``rope_theta``
    and would fall back to 10000)."""
    path = Path(dense_dir) / "config.json"
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") != "llama":
        raise ExpertCacheError(f"{path}: model_type {cfg.get('model_type')!r}, expected 'llama'")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias") or cfg.get("attention_bias"):
        raise ExpertCacheError(f"{path}: expected a SwiGLU MLP (silu) without biases")
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        if rope.get("rope_type", "default") != "default":
            raise ExpertCacheError(f"{path}: rope_type {rope['rope_type']!r} is not supported")
        cfg["rope_theta"] = rope["rope_theta"]
    if "rope_theta" not in cfg:
        raise ExpertCacheError(f"{path}: no rope_theta")
    return cfg


def load_dense(dense_dir: Path) -> llama.Model:
    """The dense model as a stock mlx-lm Llama, float32, with its config's RoPE base."""
    cfg = dense_config(dense_dir)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    weights = {}
    for f in sorted(Path(dense_dir).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    if "model.embed_tokens.weight" not in weights and cfg.get("tie_word_embeddings"):
        # The cached float copy kept the tied matrix under lm_head's name.
        weights["model.embed_tokens.weight"] = weights["lm_head.weight"]
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def _layer_activations(model: llama.Model, chunks: Sequence[mx.array]):
    """Per layer: (MLP input x (N, D), neuron activations a (N, F)) over every chunk, float32
    numpy, N = all calibration tokens. The dense model runs layer by layer."""
    hs = [model.model.embed_tokens(c[None]) for c in chunks]  # each (1, L, D)
    for layer in model.model.layers:
        xs, acts = [], []
        for i, h in enumerate(hs):
            h = h + layer.self_attn(layer.input_layernorm(h), create_attention_mask(h), None)
            x = layer.post_attention_layernorm(h)
            a = nn.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)  # (1, L, F)
            hs[i] = h + layer.mlp.down_proj(a)
            mx.eval(hs[i], x, a)
            xs.append(np.array(x[0]))
            acts.append(np.array(a[0]))
        yield np.concatenate(xs), np.concatenate(acts)


def balanced_kmeans(features: np.ndarray, k: int, iters: int, seed: int) -> np.ndarray:
    """features: (F, T) unit rows -> (F,) cluster ids, every cluster F / k rows.

    Spherical k-means whose assignment step fills each cluster up to F / k, pairs taken in
    order of cosine similarity (greedy balanced assignment)."""
    n = features.shape[0]
    size = n // k
    rng = np.random.default_rng(seed)
    centroids = features[rng.choice(n, k, replace=False)]  # (k, T)
    labels = np.zeros(n, dtype=np.int64)
    previous = np.full(n, -1)
    for _ in range(iters):
        sim = features @ centroids.T  # (F, k)
        order = np.argsort(-sim, axis=None)
        labels.fill(-1)
        counts = np.zeros(k, dtype=np.int64)
        placed = 0
        for flat in order.tolist():
            j, c = divmod(flat, k)
            if labels[j] < 0 and counts[c] < size:
                labels[j] = c
                counts[c] += 1
                placed += 1
                if placed == n:
                    break
        if (labels == previous).all():
            break
        previous = labels.copy()
        for c in range(k):
            m = features[labels == c].sum(axis=0)
            centroids[c] = m / max(float(np.linalg.norm(m)), 1e-12)
    return labels


def _fit_router(x: np.ndarray, share: np.ndarray, ridge: float) -> np.ndarray:
    """x: (N, D), share: (N, E) -> W (D, E) minimising |x W - share|^2 + ridge |W|^2."""
    gram = x.T.astype(np.float64) @ x
    lam = ridge * float(np.trace(gram)) / gram.shape[0]
    return np.linalg.solve(gram + lam * np.eye(gram.shape[0]), x.T.astype(np.float64) @ share)


def _recall(pred: np.ndarray, true: np.ndarray, k: int) -> float:
    """Share of the true top-k experts (by mass) that the predicted top-k holds."""
    p = np.argpartition(-pred, k - 1, axis=1)[:, :k]
    t = np.argpartition(-true, k - 1, axis=1)[:, :k]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(p, t, strict=True)]))


def build_key(dense_dir: Path, calibration_ids: Sequence[int], config: MoefyConfig) -> str:
    """What decides the build: package version, format, settings, source and calibration.

    The source's ``config.json`` counts by its content, less ``transformers_version`` (which
    transformers release wrote the file): a copy converted by another release is the same
    model and finds the same build."""
    h = hashlib.sha256()
    h.update(f"{__version__}/{BUILD_FORMAT}/{json.dumps(asdict(config), sort_keys=True)}".encode())
    source = json.loads((Path(dense_dir) / "config.json").read_text())
    source.pop("transformers_version", None)
    h.update(json.dumps(source, sort_keys=True).encode())
    for f in sorted(Path(dense_dir).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    h.update(np.asarray(calibration_ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def moefy(
    dense_dir: str | Path,
    out_dir: str | Path,
    calibration_ids: Sequence[int],
    config: MoefyConfig | None = None,
    progress: bool = True,
) -> Path:
    """Build (or find, when ``out_dir`` already holds this build) the Mixtral MoE of the
    dense Llama checkpoint ``dense_dir``, calibrated on ``calibration_ids`` (token ids).

    Written to a temporary directory beside ``out_dir`` and renamed into place, sealed
    (integrity record) and with the dense model's tokenizer. Returns ``out_dir``.
    """
    from tqdm import tqdm

    config = config or MoefyConfig()
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    cfg = dense_config(dense_dir)
    n_neurons, n_layers = cfg["intermediate_size"], cfg["num_hidden_layers"]
    shared = config.shared_size
    if shared >= n_neurons:
        raise ExpertCacheError(
            f"shared_size must be in [0, intermediate_size={n_neurons}), got {shared}"
        )
    if (n_neurons - shared) % config.num_experts:
        raise ExpertCacheError(
            f"num_experts must divide intermediate_size - shared_size = {n_neurons - shared}, "
            f"got {config.num_experts}"
        )
    ids = np.asarray(calibration_ids, dtype=np.int64)
    if (
        ids.ndim != 1
        or len(ids) < 2 * config.num_experts
        or not ((ids >= 0).all() and (ids < cfg["vocab_size"]).all())
    ):
        raise ExpertCacheError(
            f"calibration_ids must be >= {2 * config.num_experts} token ids in "
            f"[0, {cfg['vocab_size']})"
        )
    key = build_key(dense_dir, ids, config)
    record_path = out_dir / BUILD_RECORD
    if record_path.is_file() and json.loads(record_path.read_text()).get("key") == key:
        return out_dir
    if out_dir.exists():
        raise ExpertCacheError(f"{out_dir} exists and holds another build; remove it first")

    model = load_dense(dense_dir)
    L = config.sequence_length
    chunks = [mx.array(ids[i : i + L]) for i in range(0, len(ids), L) if len(ids[i : i + L]) > 1]
    E, size = config.num_experts, (n_neurons - shared) // config.num_experts
    weights: dict[str, mx.array] = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
    }
    if shared:  # Qwen2-MoE always has an lm_head
        lm_head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens
        weights["lm_head.weight"] = lm_head.weight
    layer_stats = []
    bar = tqdm(
        total=n_layers, desc="moefy: cluster + fit router", unit="layer", disable=not progress
    )
    for i, (x, act) in enumerate(_layer_activations(model, chunks)):
        layer = model.model.layers[i]
        down = np.array(layer.mlp.down_proj.weight)  # (D, F)
        # A neuron's contribution to the output: |activation| x the norm of its down column.
        mass = np.abs(act) * np.linalg.norm(down, axis=0)  # (N, F)
        always = np.sort(np.argsort(-mass.mean(axis=0), kind="stable")[:shared])  # (shared,)
        routed = np.setdiff1d(np.arange(n_neurons), always)  # (F - shared,)
        m = mass[:, routed].T  # (F - shared, N)
        features = m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)
        labels = balanced_kmeans(features, E, config.kmeans_iters, config.seed + i)
        groups = [routed[labels == e] for e in range(E)]  # E x (size,)
        expert_mass = np.stack([mass[:, g].sum(axis=1) for g in groups], axis=1)  # (N, E)
        share = expert_mass / np.maximum(expert_mass.sum(axis=1, keepdims=True), 1e-12)
        w = _fit_router(x, share, config.ridge)  # (D, E)
        covered = np.sort(share, axis=1)[:, ::-1][:, : config.top_k].sum(axis=1)
        shared_mass = mass[:, always].sum(axis=1)  # (N,)
        layer_stats.append(
            {
                "router_recall": _recall(x @ w, share, config.top_k),
                "best_top_k_mass_share": float(covered.mean()),
                "active_mass_share": float(
                    np.mean(
                        (shared_mass + np.sort(expert_mass, axis=1)[:, -config.top_k :].sum(1))
                        / np.maximum(mass.sum(axis=1), 1e-12)
                    )
                ),
            }
        )
        gate = np.array(layer.mlp.gate_proj.weight)  # (F, D)
        up = np.array(layer.mlp.up_proj.weight)  # (F, D)
        p = f"model.layers.{i}"
        moe = f"{p}.mlp" if shared else f"{p}.block_sparse_moe"
        # The inverse of the (uniform) routing weight: Mixtral's softmax is over the top-k,
        # Qwen2-MoE's over every expert.
        expert_scale = E if shared else config.top_k
        weights[f"{moe}.gate.weight"] = mx.array((config.router_scale * w.T).astype(np.float32))
        weights[f"{moe}.switch_mlp.gate_proj.weight"] = mx.array(
            np.stack([gate[g] for g in groups])
        )
        weights[f"{moe}.switch_mlp.up_proj.weight"] = mx.array(np.stack([up[g] for g in groups]))
        weights[f"{moe}.switch_mlp.down_proj.weight"] = mx.array(
            np.stack([down[:, g] * expert_scale for g in groups])  # (E, D, size)
        )
        if shared:
            weights[f"{moe}.shared_expert.gate_proj.weight"] = mx.array(gate[always])
            weights[f"{moe}.shared_expert.up_proj.weight"] = mx.array(up[always])
            # sigmoid(0) = 1/2, exactly
            weights[f"{moe}.shared_expert.down_proj.weight"] = mx.array(down[:, always] * 2)
            weights[f"{moe}.shared_expert_gate.weight"] = mx.zeros((1, cfg["hidden_size"]))
        for name in ("input_layernorm", "post_attention_layernorm"):
            weights[f"{p}.{name}.weight"] = getattr(layer, name).weight
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            weights[f"{p}.self_attn.{proj}.weight"] = getattr(layer.self_attn, proj).weight
            if shared and proj != "o_proj":  # Qwen2's q, k, v projections have biases
                out_features = getattr(layer.self_attn, proj).weight.shape[0]
                weights[f"{p}.self_attn.{proj}.bias"] = mx.zeros((out_features,))
        bar.update(1)
    bar.close()
    moe_cfg = {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": n_layers,
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
    if shared:
        moe_cfg.update(
            model_type="qwen2_moe",
            architectures=["Qwen2MoeForCausalLM"],
            intermediate_size=n_neurons,  # unused by a model whose every layer is sparse
            moe_intermediate_size=size,
            shared_expert_intermediate_size=shared,
            num_experts=E,
            tie_word_embeddings=False,  # the lm_head is written out
        )
    else:
        moe_cfg.update(
            model_type="mixtral",
            architectures=["MixtralForCausalLM"],
            intermediate_size=size,
            num_local_experts=E,
        )
    if (
        cfg["hidden_size"] // cfg["num_attention_heads"] != cfg.get("head_dim", 0)
        and "head_dim" in cfg
    ):
        raise ExpertCacheError(
            "Mixtral and Qwen2-MoE derive head_dim = hidden_size / heads; this model differs"
        )
    record = {
        "format": BUILD_FORMAT,
        "key": key,
        "package_version": __version__,
        "source": str(dense_dir),
        "calibration_tokens": len(ids),
        "config": asdict(config),
        "layers": layer_stats,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        _write_checkpoint(tmp, weights, moe_cfg, n_layers, config.shards)
        for name in TOKENIZER_FILES:
            if (dense_dir / name).is_file():
                shutil.copyfile(dense_dir / name, tmp / name)
        seal_model(tmp)
        (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=1))
        tmp.chmod(umask_mode(directory=True))  # mkdtemp made it 0o700
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_checkpoint(path: Path, weights: dict, cfg: dict, n_layers: int, shards: int) -> None:
    """Shards of whole layers (the embedding and final norm in the first) plus the index."""
    shards = min(shards, n_layers)
    groups: list[dict[str, mx.array]] = [{} for _ in range(shards)]
    for name, w in weights.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0
        groups[layer * shards // n_layers][name] = w
    weight_map, total = {}, 0
    for s, group in enumerate(groups):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), group, metadata={"format": "mlx"})
        for name, w in group.items():
            weight_map[name] = fname
            total += w.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def moefy_cached(
    dense_dir: str | Path,
    cache_root: str | Path,
    config: MoefyConfig | None = None,
    progress: bool = True,
) -> Path:
    """:func:`moefy` calibrated on :func:`moe_expert_cache.calibration.calibration_text`,
    built once into ``cache_root`` under a name that carries the package version and the
    build key (so a new version, setting or source builds anew, and an old build is never
    taken for a new one). Returns the checkpoint's directory."""
    from mlx_lm.utils import load_tokenizer

    from moe_expert_cache.calibration import calibration_text

    config = config or MoefyConfig()
    dense_dir = Path(dense_dir)
    ids = load_tokenizer(dense_dir).encode(calibration_text())
    key = build_key(dense_dir, ids, config)[:12]
    shared = f"-shared{config.shared_size}" if config.shared_size else ""
    name = f"{dense_dir.name}-moe{config.num_experts}-top{config.top_k}{shared}-{__version__}-{key}"
    return moefy(dense_dir, Path(cache_root) / name, ids, config, progress=progress)
