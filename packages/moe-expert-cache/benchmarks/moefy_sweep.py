"""#57: where the MoEfied SmolLM2 loses its quality. Held-out perplexity against the dense
model for expert layouts (experts per layer, shared neurons, top-k) under two routers:
moefy's own (balanced k-means on activation mass, ridge-fitted linear router, from
``membound_testing.moefy.split``) and the oracle (the top-k experts by their true activation
mass: what no stock router can do, the bound of the grouping itself); and with the
calibration text alone or with tokens sampled from the dense model added.

Routing is applied by masking each MLP's neuron activations in the transformers model: a
chosen expert's neurons count with weight 1, as in moefy's checkpoints (their router softmax
is uniform to ~1e-3 and down_proj carries the inverse weight). The row of 0.10's demo
layout (shared 256 + top-6 of 16) reproduced ``moefy_quality``'s figures on the mlx-lm
checkpoint (248, 86, 43 against 248, 85, 43 on 2026-12-06, 0.10's calibration). The last
layout is the demo's build (``membound_testing.moefy.demo_config``). Deterministic (seeded
sampling); not timing. ``--quick``: two layouts, 64 tokens per text.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from _common import COMMAND, write_result
from texts import texts
from transformers import AutoModelForCausalLM, AutoTokenizer

from membound_testing.models import causal_lm_perplexity, smollm2_float_dir
from membound_testing.moefy import calibration_text
from membound_testing.moefy.split import expert_shares, fit_router, group_neurons, neuron_mass

WINDOW = 512
SAMPLED = 8192  # tokens sampled from the dense model: 16 sequences of 512
# (experts, shared neurons, top-k): the first demo build (0.10), finer experts at half the
# routed, larger shared experts, and the demo's build (membound_testing.moefy.demo_config)
LAYOUTS = [
    (16, 256, 6),
    (16, 256, 8),
    (128, 256, 64),
    (64, 1024, 32),
    (128, 1024, 64),
    (128, 1152, 48),
]


def mlp_inputs_and_activations(model, sequences: list[list[int]]):
    """Per layer: the MLP inputs (N, D) and neuron activations (N, F) over the sequences."""
    layers = model.model.layers
    xs, acts = [[] for _ in layers], [[] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a, i=i: xs[i].append(a[0][0])))
        hooks.append(
            layer.mlp.down_proj.register_forward_pre_hook(lambda m, a, i=i: acts[i].append(a[0][0]))
        )
    for ids in sequences:
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return [torch.cat(x).numpy() for x in xs], [torch.cat(a).numpy() for a in acts]


def routed_masks(model, X, A, experts: int, shared: int, top_k: int, oracle: bool):
    """Per layer, a function (x, act) -> neuron mask of the layout under the router."""
    masks = []
    for i, layer in enumerate(model.model.layers):
        down = layer.mlp.down_proj.weight.numpy()
        mass = neuron_mass(A[i], down)
        _, groups = group_neurons(mass, shared, experts, 10, i)  # moefy's defaults, seed 0
        expert_of = np.full(mass.shape[1], experts)  # the shared neurons: a last, fixed slot
        for e, group in enumerate(groups):
            expert_of[group] = e
        expert_of = torch.tensor(expert_of)
        if oracle:
            router, norm = None, torch.tensor(np.linalg.norm(down, axis=0))
        else:
            share = expert_shares(mass, groups)[1]
            router, norm = torch.tensor(fit_router(X[i], share, 1e-3).astype(np.float32)), None

        def mask(x, act, router=router, norm=norm, expert_of=expert_of):
            if router is None:  # each expert's true mass
                scores = torch.zeros(*act.shape[:-1], experts + 1)
                scores.scatter_add_(-1, expert_of.expand_as(act), act.abs() * norm)
                scores = scores[..., :experts]
            else:
                scores = x @ router
            chosen = torch.zeros(*act.shape[:-1], experts + 1, dtype=torch.bool)
            chosen.scatter_(-1, scores.topk(top_k, dim=-1).indices, True)
            chosen[..., experts] = True
            return chosen[..., expert_of].to(act.dtype)

        masks.append(mask)
    return masks


def masked_perplexities(model, masks, held_out: dict) -> list[float]:
    originals = []
    for layer, mask in zip(model.model.layers, masks, strict=True):
        mlp = layer.mlp
        originals.append(mlp.forward)

        def forward(x, mlp=mlp, mask=mask):
            act = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
            return mlp.down_proj(act * mask(x, act))

        mlp.forward = forward
    try:
        return [causal_lm_perplexity(model, ids, WINDOW) for ids in held_out.values()]
    finally:
        for layer, original in zip(model.model.layers, originals, strict=True):
            layer.mlp.forward = original


def sampled_sequences(model, tokenizer, n_tokens: int) -> list[list[int]]:
    torch.manual_seed(0)
    start = torch.full((16, 1), tokenizer.bos_token_id)
    out = model.generate(
        start,
        do_sample=True,
        top_p=0.95,
        max_new_tokens=n_tokens // 16,
        min_new_tokens=n_tokens // 16,
        pad_token_id=tokenizer.eos_token_id,
    )
    return out.tolist()


@torch.no_grad()
def run(quick: bool = False, command: str = COMMAND) -> dict:
    source = smollm2_float_dir()
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    held_out = {kind: tokenizer(t)["input_ids"] for kind, t in texts().items()}
    layouts, sampled = LAYOUTS, SAMPLED
    if quick:
        held_out = {kind: ids[:64] for kind, ids in held_out.items()}
        layouts, sampled = LAYOUTS[:2], 512
    dense = [causal_lm_perplexity(model, ids, WINDOW) for ids in held_out.values()]
    ids = tokenizer(calibration_text())["input_ids"]
    calibration = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]
    X, A = mlp_inputs_and_activations(model, calibration)
    rows = [["dense SmolLM2-135M", "-", *(round(p, 3) for p in dense)]]
    worst = {}  # (layout, router) -> the largest ratio to dense over the texts

    def add(name: str, router: str, ppl: list[float]) -> None:
        ratios = [p / d for p, d in zip(ppl, dense, strict=True)]
        rows.append(
            [name, router, *(f"{p:.2f} ({r:.2f}x)" for p, r in zip(ppl, ratios, strict=True))]
        )
        worst[name, router] = max(ratios)

    for experts, shared, top_k in layouts:
        size = (1536 - shared) // experts
        name = f"shared {shared} + top-{top_k} of {experts} x {size}"
        for oracle in (False, True):
            masks = routed_masks(model, X, A, experts, shared, top_k, oracle)
            add(name, "oracle" if oracle else "ridge", masked_perplexities(model, masks, held_out))
    extra = sampled_sequences(model, tokenizer, sampled)
    X2, A2 = mlp_inputs_and_activations(model, calibration + extra)
    for experts, shared, top_k in dict.fromkeys((layouts[1], layouts[-1])):  # demo's last
        masks = routed_masks(model, X2, A2, experts, shared, top_k, False)
        name = f"shared {shared} + top-{top_k} of {experts} x {(1536 - shared) // experts}"
        add(name, f"ridge, + {sampled} sampled tokens", masked_perplexities(model, masks, held_out))
    best = min((k for k in worst if k[1] != "oracle"), key=worst.get)
    return write_result(
        "moefy_sweep",
        "MoEfied SmolLM2-135M: held-out perplexity by expert layout and router (#57)",
        ["layout", "router", *(f"{kind} ({len(ids)} tokens)" for kind, ids in held_out.items())],
        rows,
        [
            {
                "target": "#57: held-out perplexity <= 1.3x dense on each text, at most half "
                "the routed neurons per token",
                "measured": "best stock-router row: {} ({}), worst text {:.2f}x".format(
                    *best, worst[best]
                ),
                "met": worst[best] <= 1.3,
            }
        ],
        f"Routing by masking the transformers model's MLP activations (weight 1 per chosen "
        f"expert, as moefy's checkpoints compute). Calibration: "
        f"membound_testing.moefy.calibration ({len(ids)} tokens); '+ sampled': {sampled} tokens "
        "sampled from the dense model (top-p 0.95, seed 0) added. Held-out texts: "
        "benchmarks/texts.py, teacher-forced in windows of 512. Oracle: the top-k experts by "
        "their true activation mass, the bound of the grouping. Deterministic, not timing.",
        quick=quick,
        command=command,
    )


if __name__ == "__main__":
    run(
        "--quick" in sys.argv,
        "hatch run python packages/moe-expert-cache/benchmarks/moefy_sweep.py",
    )
