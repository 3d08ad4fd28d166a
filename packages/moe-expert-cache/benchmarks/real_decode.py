"""Greedy decode on the real MoEs (MoEfied SmolLM2: the top-4 Mixtral and the demo's
shared-expert Qwen2-MoE): stock mlx-lm against the cache at 100% and 50% capacity (exact
mode; 50% also with the embedding table mapped), interleaved in one run. Tokens/s, the
tokens themselves, resident expert bytes, and MLX's buffers after each load.

    hatch run moe-expert-cache:python packages/moe-expert-cache/benchmarks/real_decode.py
"""

from __future__ import annotations

import gc
import os
import statistics

import mlx.core as mx
from _common import write_result
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, load_tokenizer
from smollm2_moe import smollm2_moe
from texts import texts

from membound_testing.moefy import MoefyConfig
from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model

COMMAND = "hatch run moe-expert-cache:python packages/moe-expert-cache/benchmarks/real_decode.py"
MODELS = {
    "top-4 of 16 (Mixtral)": MoefyConfig(),
    "shared 256 + top-6 of 16 (Qwen2-MoE, the demo's)": MoefyConfig(shared_size=256, top_k=6),
}
STOCK = "stock mlx-lm (every expert resident)"
VARIANTS = {  # name -> ExpertCacheConfig
    "exact 100%": ExpertCacheConfig(capacity_share=1.0, mode="exact"),
    "exact 50%": ExpertCacheConfig(capacity_share=0.5, mode="exact"),
    "exact 50%, embedding mapped": ExpertCacheConfig(
        capacity_share=0.5, mode="exact", map_embeddings=True
    ),
}
QUESTION = "What is the capital of France?"
MiB = 2**20


def _loaded(load):
    """(what load() returns, MLX bytes it added)."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    out = load()
    return out, mx.get_active_memory() - before


def held_expert_bytes(manager) -> int:
    """Bytes of the arrays the cached MoE blocks compute from: every layer's resident
    expert stacks (each projection's weight, and scales / biases when quantized)."""
    return sum(
        array.nbytes
        for layer in manager.layers
        for proj in layer.projections.values()
        for _, array in tree_flatten(proj.parameters())
    )


def prompts(tokenizer, length: int) -> dict[str, list[int]]:
    """The demo's chat question, and the first tokens of two held-out texts."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    out = {"chat question": chat}
    for kind in ("chat", "code"):
        out[f"{kind} text"] = tokenizer.encode(texts()[kind])[:length]
    return out


def run_model(label: str, config: MoefyConfig, rounds: int, new_tokens: int, length: int):
    path = smollm2_moe(config)
    tokenizer = load_tokenizer(path)
    asks = prompts(tokenizer, length)
    (stock, _), stock_bytes = _loaded(lambda: load_model(path))
    variants = {STOCK: (stock, None, stock_bytes)}
    for name, cfg in VARIANTS.items():
        if cfg.map_embeddings and "lm_head" not in stock:
            continue  # tied: map_embeddings refuses it (the same test map_embedding makes)
        cm, nbytes = _loaded(lambda cfg=cfg: load_cached_model(path, cfg))
        variants[name] = (cm.model, cm.manager, nbytes)
    names = list(variants)
    speeds = {n: [] for n in names}
    same = dict.fromkeys(names, True)
    for r in range(rounds + 1):  # round 0 warms up and is not timed
        order = names[r % len(names) :] + names[: r % len(names)]
        for ids in asks.values():
            out = {}
            for name in order:
                model, manager, _ = variants[name]
                out[name] = generate(model, ids, new_tokens, manager)
                if r > 0:
                    speeds[name].append(out[name].tokens_per_s)
            for name in names:
                same[name] &= out[name].tokens == out[STOCK].tokens
    answer = tokenizer.decode(
        generate(stock, asks["chat question"], new_tokens).tokens, skip_special_tokens=True
    ).strip()
    stock_tps = statistics.median(speeds[STOCK])
    rows, targets = [], []
    for name in names:
        model, manager, nbytes = variants[name]
        tps = statistics.median(speeds[name])
        row = [label, name, f"{tps:.2f} ({min(speeds[name]):.2f}-{max(speeds[name]):.2f})"]
        row.append(round(tps / stock_tps, 3))
        if manager is None:
            row += ["", "", ""]
        else:
            layer = manager.layers[0]
            got = held_expert_bytes(manager)
            capacity = round(VARIANTS[name].capacity_share * layer.slots.num_experts)
            expected = capacity * layer.expert_nbytes * len(manager.layers)
            row += [
                f"{got / MiB:.1f} of {manager.all_expert_bytes() / MiB:.1f}",
                "yes" if got == expected else f"no (expected {expected})",
                round(manager.total_metrics().hit_rate, 4),
            ]
            if name == "exact 50%":
                targets.append(
                    {
                        "target": f"{label}, 50% capacity: resident expert bytes = capacity x "
                        "expert size, and stock's answer",
                        "measured": f"{got} B vs {capacity} x {layer.expert_nbytes} B x "
                        f"{len(manager.layers)} layers = {expected} B; tokens "
                        f"{'equal' if same[name] else 'differ'}",
                        "met": got == expected and same[name],
                    }
                )
        row += [f"{nbytes / MiB:.0f}", "yes" if same[name] else "no"]
        rows.append(row)
    full = statistics.median(speeds["exact 100%"])
    targets.insert(
        0,
        {
            "target": f"{label}, 100% capacity (exact): >= 0.9x stock tokens/s",
            "measured": f"{full / stock_tps:.3f}x ({full:.2f} vs {stock_tps:.2f} tokens/s)",
            "met": full / stock_tps >= 0.9,
        },
    )
    return rows, targets, f"{label}: {path.name}, answers {answer!r}"


def run(quick: bool = False, command: str = COMMAND) -> dict:
    rounds, new_tokens, length = (1, 6, 16) if quick else (5, 24, 32)
    load_start = os.getloadavg()[0]
    rows, targets, built = [], [], []
    for label, config in MODELS.items():
        r, t, b = run_model(label, config, rounds, new_tokens, length)
        rows += r
        targets += t
        built.append(b)
    load_end = os.getloadavg()[0]
    notes = (
        f"Greedy decode of {new_tokens} tokens (the package's generate loop, which also runs "
        "the stock model) after each of three prompts: the demo's chat question with the "
        f"chat template, and the first {length} tokens of the held-out chat and code texts "
        f"(benchmarks/texts.py). {rounds} rounds after a warm-up round, variants interleaved "
        "in an order rotated every round, every prompt in every round; tokens/s: median over "
        "rounds and prompts (min-max). Each cached variant keeps its cache across prompts and "
        "rounds. The top-4 build keeps SmolLM2's tied lm_head, so its embedding is not "
        "mapped (map_embeddings refuses a tied table). Resident expert MiB: the bytes of "
        "the expert stacks the cached blocks "
        "compute from (every projection's arrays), against MoE layers x capacity x expert "
        "size. MLX MiB: MLX's active memory added by the load "
        "(weights; the KV cache comes later). Stock's tokens: every prompt, every round. "
        + "; ".join(built)
        + f". mlx[cpu] {mx.__version__}. 1-minute load average {load_start:.2f} at the "
        f"start, {load_end:.2f} at the end (2 cores)."
    )
    return write_result(
        "real_decode",
        "the real MoEs (MoEfied SmolLM2): decode tokens/s, resident expert bytes and "
        "answers vs stock mlx-lm",
        [
            "model",
            "variant",
            "tokens/s (min-max)",
            "x stock",
            "resident expert MiB",
            "= capacity x expert size",
            "hit rate",
            "MLX MiB after load",
            "stock's tokens",
        ],
        rows,
        targets,
        notes,
        quick=quick,
        command=command,
    )


if __name__ == "__main__":
    import sys

    run("--quick" in sys.argv)
