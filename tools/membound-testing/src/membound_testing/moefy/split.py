"""One dense layer's MLP split into experts: its neurons clustered by when they fire on the
calibration tokens, a linear router fitted to each expert's share of the activation mass,
and the MoE block's weights written out."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from membound_testing.moefy.config import BuildPlan


def layer_activations(
    model: llama.Model, chunks: Sequence[np.ndarray]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per layer: (MLP input x (N, D), neuron activations a (N, F)) over every chunk, float32
    numpy, N = all calibration tokens. The dense model runs layer by layer, each chunk a
    causal sequence of its own.

    The matrix products run in numpy (BLAS): MLX's CPU matmul on Linux is ~60x slower here
    (3 against 196 GFLOP/s on 512 x 576 x 1536), which made this forward 9 s a layer. The
    norms and RoPE are the layer's own MLX modules (elementwise, cheap), so any RoPE
    scaling the checkpoint sets is applied as mlx-lm applies it; ``test_moefy`` checks the
    result against mlx-lm's own forward.
    """
    hs = [np.array(model.model.embed_tokens(mx.array(c)), dtype=np.float32) for c in chunks]
    for layer in model.model.layers:
        xs, acts = [], []
        attn, mlp = layer.self_attn, layer.mlp
        qkvo_t = [_w(m).T for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
        gate_t, up_t, down_t = (_w(m).T for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        for i, h in enumerate(hs):
            h = h + _attention(attn, qkvo_t, _mx_apply(layer.input_layernorm, h))
            x = _mx_apply(layer.post_attention_layernorm, h)
            g = x @ gate_t
            a = g * 0.5 * (1.0 + np.tanh(0.5 * g)) * (x @ up_t)  # silu(gate x) * up x
            hs[i] = h + a @ down_t
            xs.append(x)
            acts.append(a)
        yield np.concatenate(xs), np.concatenate(acts)


def _w(linear) -> np.ndarray:
    return np.array(linear.weight, dtype=np.float32)


def _mx_apply(module, x: np.ndarray) -> np.ndarray:
    return np.array(module(mx.array(x)), dtype=np.float32)


def _attention(attn, qkvo_t: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """mlx-lm Llama attention over one causal sequence x (L, D), without a cache; qkvo_t:
    its q, k, v and o projections' weights, transposed."""
    L = x.shape[0]
    q_t, k_t, v_t, o_t = qkvo_t
    q = (x @ q_t).reshape(L, attn.n_heads, -1).transpose(1, 0, 2)
    k = (x @ k_t).reshape(L, attn.n_kv_heads, -1).transpose(1, 0, 2)
    v = (x @ v_t).reshape(L, attn.n_kv_heads, -1).transpose(1, 0, 2)
    q, k = _mx_apply(attn.rope, q), _mx_apply(attn.rope, k)  # (H, L, hd): RoPE over L
    repeat = attn.n_heads // attn.n_kv_heads  # grouped-query heads share a KV head
    k, v = np.repeat(k, repeat, axis=0), np.repeat(v, repeat, axis=0)
    scores = (q * attn.scale) @ k.transpose(0, 2, 1)  # (H, L, L)
    scores += np.triu(np.full((L, L), -np.inf, dtype=np.float32), 1)  # causal
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    out = (scores / scores.sum(axis=-1, keepdims=True)) @ v  # (H, L, hd)
    return out.transpose(1, 0, 2).reshape(L, -1) @ o_t


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


def neuron_mass(act: np.ndarray, down: np.ndarray) -> np.ndarray:
    """A neuron's contribution to the output per token: |activation| x the norm of its down
    column. act: (N, F), down: (D, F) -> (N, F)."""
    return np.abs(act) * np.linalg.norm(down, axis=0)


def group_neurons(
    mass: np.ndarray, shared: int, num_experts: int, iters: int, seed: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The ``shared`` neurons of largest mean mass, and the others in ``num_experts`` equal
    groups of neurons that carry mass on the same tokens (:func:`balanced_kmeans`).

    Args:
        mass: (N, F) :func:`neuron_mass` over the calibration tokens.
        shared: Neurons every token runs.
        num_experts: Groups of the other neurons; divides F - shared.
        iters: k-means rounds at most.
        seed: Picks the first centroids.

    Returns:
        The shared neurons (shared,), sorted, and each group's neurons, sorted.
    """
    always = np.sort(np.argsort(-mass.mean(axis=0), kind="stable")[:shared])  # (shared,)
    routed = np.setdiff1d(np.arange(mass.shape[1]), always)  # (F - shared,)
    m = mass[:, routed].T  # (F - shared, N)
    features = m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)
    labels = balanced_kmeans(features, num_experts, iters, seed)
    return always, [routed[labels == e] for e in range(num_experts)]


def expert_shares(mass: np.ndarray, groups: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each group's mass per token (N, E), and its share of the routed mass (N, E)."""
    expert_mass = np.stack([mass[:, g].sum(axis=1) for g in groups], axis=1)
    return expert_mass, expert_mass / np.maximum(expert_mass.sum(axis=1, keepdims=True), 1e-12)


def fit_router(x: np.ndarray, share: np.ndarray, ridge: float) -> np.ndarray:
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
    config, shared = plan.config, plan.config.shared_size
    E, top_k = config.num_experts, config.top_k
    down = np.array(layer.mlp.down_proj.weight)  # (D, F)
    mass = neuron_mass(act, down)  # (N, F)
    always, groups = group_neurons(mass, shared, E, config.kmeans_iters, config.seed + index)
    expert_mass, share = expert_shares(mass, groups)  # (N, E) each
    w = fit_router(x, share, config.ridge)  # (D, E)
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
