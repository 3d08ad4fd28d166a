"""One dense layer's MLP split into experts: its neurons clustered by when they fire on the
calibration tokens, a linear router fitted to each expert's share of the activation mass,
and the MoE block's weights written out."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from membound_testing.moefy.config import BuildPlan


def layer_activations(
    model: llama.Model, chunks: Sequence[np.ndarray]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per layer: (MLP input x (N, D), neuron activations a (N, F)) over every chunk, float32
    numpy, N = all calibration tokens. The dense model runs layer by layer."""
    hs = [model.model.embed_tokens(mx.array(c)[None]) for c in chunks]  # each (1, L, D)
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
    """Spherical k-means whose assignment step fills each cluster up to F / k, pairs taken
    in order of cosine similarity (greedy balanced assignment).

    Args:
        features: (F, T) float, unit rows.
        k: The number of clusters; divides F.
        iters: At most this many rounds (fewer when the labels stop changing).
        seed: Picks the first centroids.

    Returns:
        (F,) int64 cluster ids, F / k rows in every cluster.
    """
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


def split_layer(
    layer, index: int, x: np.ndarray, act: np.ndarray, plan: BuildPlan
) -> tuple[dict, dict[str, mx.array]]:
    """Split dense decoder layer ``index`` into the MoE layer ``plan`` describes.

    Args:
        layer: The dense mlx-lm Llama decoder layer.
        index: Its position in the model.
        x: (N, D) float32, the MLP's input over the calibration tokens.
        act: (N, F) float32, the neuron activations silu(gate x) * up x there.
        plan: The checked build.

    Returns:
        The layer's router statistics on the calibration tokens, and its weights by
        checkpoint name (attention and norms unchanged, the MoE block new).
    """
    config, n_neurons, shared = plan.config, plan.n_neurons, plan.config.shared_size
    E, top_k = config.num_experts, config.top_k
    down = np.array(layer.mlp.down_proj.weight)  # (D, F)
    # A neuron's contribution to the output: |activation| x the norm of its down column.
    mass = np.abs(act) * np.linalg.norm(down, axis=0)  # (N, F)
    always = np.sort(np.argsort(-mass.mean(axis=0), kind="stable")[:shared])  # (shared,)
    routed = np.setdiff1d(np.arange(n_neurons), always)  # (F - shared,)
    m = mass[:, routed].T  # (F - shared, N)
    features = m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)
    labels = balanced_kmeans(features, E, config.kmeans_iters, config.seed + index)
    groups = [routed[labels == e] for e in range(E)]  # E x (size,)
    expert_mass = np.stack([mass[:, g].sum(axis=1) for g in groups], axis=1)  # (N, E)
    share = expert_mass / np.maximum(expert_mass.sum(axis=1, keepdims=True), 1e-12)
    w = _fit_router(x, share, config.ridge)  # (D, E)
    covered = np.sort(share, axis=1)[:, ::-1][:, :top_k].sum(axis=1)
    shared_mass = mass[:, always].sum(axis=1)  # (N,)
    stats = {
        "router_recall": _recall(x @ w, share, top_k),
        "best_top_k_mass_share": float(covered.mean()),
        "active_mass_share": float(
            np.mean(
                (shared_mass + np.sort(expert_mass, axis=1)[:, -top_k:].sum(1))
                / np.maximum(mass.sum(axis=1), 1e-12)
            )
        ),
    }
    gate = np.array(layer.mlp.gate_proj.weight)  # (F, D)
    up = np.array(layer.mlp.up_proj.weight)  # (F, D)
    p = f"model.layers.{index}"
    moe = f"{p}.mlp" if shared else f"{p}.block_sparse_moe"
    # The inverse of the (uniform) routing weight: Mixtral's softmax is over the top-k,
    # Qwen2-MoE's over every expert.
    expert_scale = E if shared else top_k
    weights = {
        f"{moe}.gate.weight": mx.array((config.router_scale * w.T).astype(np.float32)),
        f"{moe}.switch_mlp.gate_proj.weight": mx.array(np.stack([gate[g] for g in groups])),
        f"{moe}.switch_mlp.up_proj.weight": mx.array(np.stack([up[g] for g in groups])),
        f"{moe}.switch_mlp.down_proj.weight": mx.array(
            np.stack([down[:, g] * expert_scale for g in groups])  # (E, D, size)
        ),
    }
    if shared:
        weights[f"{moe}.shared_expert.gate_proj.weight"] = mx.array(gate[always])
        weights[f"{moe}.shared_expert.up_proj.weight"] = mx.array(up[always])
        # sigmoid(0) = 1/2, exactly
        weights[f"{moe}.shared_expert.down_proj.weight"] = mx.array(down[:, always] * 2)
        weights[f"{moe}.shared_expert_gate.weight"] = mx.zeros((1, plan.source["hidden_size"]))
    for name in ("input_layernorm", "post_attention_layernorm"):
        weights[f"{p}.{name}.weight"] = getattr(layer, name).weight
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        weights[f"{p}.self_attn.{proj}.weight"] = getattr(layer.self_attn, proj).weight
        if shared and proj != "o_proj":  # Qwen2's q, k, v projections have biases
            out_features = getattr(layer.self_attn, proj).weight.shape[0]
            weights[f"{p}.self_attn.{proj}.bias"] = mx.zeros((out_features,))
    return stats, weights
