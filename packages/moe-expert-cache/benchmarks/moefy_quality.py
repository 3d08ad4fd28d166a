"""Perplexity of the MoEfied SmolLM2 at top-k 2, 4, 8 and 16 of 16 beside the dense model, on
three held-out texts, and the router's recall of the experts carrying the most mass.
Deterministic, not timing: run it niced."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from _common import write_result
from mlx_lm.utils import load_model, load_tokenizer
from smollm2_moe import smollm2_moe
from texts import texts

from membound_testing.moefy import BUILD_RECORD, demo_config, load_dense

TOP_KS = (2, 4, 8, 16)
WINDOW = 512


def perplexity(model: nn.Module, ids: list[int]) -> float:
    """exp(mean next-token NLL), teacher-forced in windows of WINDOW tokens."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        chunk = mx.array(ids[start : start + WINDOW + 1])
        if chunk.size < 2:
            break
        logits = model(chunk[None, :-1])[0].astype(mx.float32)  # (L, vocab)
        loss = nn.losses.cross_entropy(logits, chunk[1:], reduction="sum")
        nll += float(loss.item())
        count += chunk.size - 1
    return float(np.exp(nll / count))


def set_top_k(model: nn.Module, k: int) -> None:
    """Route each token to k experts: the checkpoint's down_proj carries the factor of its
    own top-k (the softmax over the top-k is ~1/k), so rescale it by k / that top-k."""
    for layer in model.model.layers:
        block = layer.block_sparse_moe
        down = block.switch_mlp.down_proj
        down.weight = down.weight * (k / block.num_experts_per_tok)
        block.num_experts_per_tok = k


def run(quick: bool = False) -> dict:
    path = smollm2_moe()
    record = json.loads((path / BUILD_RECORD).read_text())
    built_k = record["config"]["top_k"]
    tokenizer = load_tokenizer(path)
    held_out = {kind: tokenizer.encode(t) for kind, t in texts().items()}
    if quick:
        held_out = {kind: ids[:128] for kind, ids in held_out.items()}
    dense = load_dense(Path(record["source"]))
    rows = [
        ["dense SmolLM2-135M"] + [round(perplexity(dense, ids), 3) for ids in held_out.values()]
    ]
    del dense
    results = {}
    for k in TOP_KS:
        model, _ = load_model(path)
        set_top_k(model, k)
        results[k] = [perplexity(model, ids) for ids in held_out.values()]
        rows.append([f"MoE top-{k} of 16"] + [round(p, 3) for p in results[k]])
    demo = demo_config()
    shared_path = smollm2_moe(demo)
    shared_record = json.loads((shared_path / BUILD_RECORD).read_text())
    model, _ = load_model(shared_path)
    shared = [perplexity(model, ids) for ids in held_out.values()]
    del model
    size = json.loads((shared_path / "config.json").read_text())["moe_intermediate_size"]
    rows.append(
        [
            f"MoE shared {demo.shared_size} + top-{demo.top_k} of {demo.num_experts} x {size} "
            "(the demo's build)"
        ]
        + [round(p, 3) for p in shared]
    )
    shared_recall = [layer["router_recall"] for layer in shared_record["layers"]]
    recall = [layer["router_recall"] for layer in record["layers"]]
    mass = [layer["best_top_k_mass_share"] for layer in record["layers"]]
    dense_row = rows[0][1:]
    targets = [
        {
            "target": "top-16 of 16 (every expert) equals the dense model (perplexity within 1%)",
            "measured": ", ".join(
                f"{kind} {m:.3f} vs {d:.3f}"
                for kind, m, d in zip(held_out, results[16], dense_row, strict=True)
            ),
            "met": all(abs(m / d - 1) < 0.01 for m, d in zip(results[16], dense_row, strict=True)),
        },
        {
            "target": "#57: the demo's build within 1.3x the dense model's perplexity on each "
            "text, at most half the routed neurons per token",
            "measured": ", ".join(
                f"{kind} {m / d:.3f}x"
                for kind, m, d in zip(held_out, shared, dense_row, strict=True)
            )
            + f" (top-{demo.top_k} of {demo.num_experts})",
            "met": all(m / d <= 1.3 for m, d in zip(shared, dense_row, strict=True))
            and demo.top_k <= demo.num_experts / 2,
        },
    ]
    return write_result(
        "moefy",
        "MoEfied SmolLM2-135M: held-out perplexity at top-k of 16 experts vs the dense model",
        ["model", *(f"{kind} ({len(ids)} tokens)" for kind, ids in held_out.items())],
        rows,
        targets,
        f"Built by membound_testing.moefy from SmolLM2-135M-Instruct (float32): 30 layers x "
        f"{record['config']['num_experts']} experts x 96 neurons, balanced k-means on "
        f"neuron activation mass over {record['calibration_tokens']} calibration tokens "
        "(membound_testing.moefy.calibration: prose, package source and a chat transcript), ridge-fitted linear "
        f"routers. Router recall of the top-{built_k} experts by mass on the calibration "
        f"tokens: mean {np.mean(recall):.3f} (layers {min(recall):.3f}-{max(recall):.3f}); the "
        f"best {built_k} experts hold {np.mean(mass):.3f} of the activation mass on average. "
        f"Held-out texts: benchmarks/texts.py (prose, chat transcript, this package's "
        f"simulator.py + trace.py), teacher-forced in windows of {WINDOW} tokens. Top-k "
        "other than the built one: same checkpoint with down_proj rescaled by k / "
        f"{built_k}. The demo's build ({shared_path.name}, membound_testing.moefy.demo_config): "
        f"every token runs the {demo.shared_size} shared neurons plus {demo.top_k} routed "
        f"experts of {size} ({demo.shared_size + demo.top_k * size} of 1,536); router recall "
        f"of its top-{demo.top_k} by mass on the calibration tokens: mean {np.mean(shared_recall):.3f} (layers "
        f"{min(shared_recall):.3f}-{max(shared_recall):.3f}). Deterministic, not timing.",
        quick=quick,
    )


if __name__ == "__main__":
    import sys

    run("--quick" in sys.argv)
