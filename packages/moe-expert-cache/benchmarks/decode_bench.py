"""Decode speed and resident expert bytes at 25/50/75/100% capacity, exact and skip,
against the stock fully resident mlx-lm model, interleaved in one run."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import numpy as np
from _common import bench_model, write_result
from mlx_lm.utils import load_model

from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model

CAPACITIES = (0.25, 0.5, 0.75, 1.0)
STOCK = "stock (all experts resident)"


def _spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def run(quick: bool = False) -> dict:
    rounds, prompt_len, new_tokens = (1, 8, 8) if quick else (5, 12, 24)
    with tempfile.TemporaryDirectory() as tmp:
        path, config = bench_model(Path(tmp), quick)
        stock, _ = load_model(path)
        variants = {STOCK: (stock, None)}
        cached_models = {}
        for mode in ("exact", "skip"):
            for cap in CAPACITIES:
                cm = load_cached_model(path, ExpertCacheConfig(capacity_share=cap, mode=mode))
                cached_models[mode, cap] = cm
                variants[f"{mode} {int(cap * 100)}%"] = (cm.model, cm.manager)
        rng = np.random.default_rng(0)
        vocab = config["vocab_size"]
        speeds = {name: [] for name in variants}
        same_tokens = dict.fromkeys(variants, True)
        for r in range(rounds + 1):  # round 0 warms every variant up and is not timed
            prompt = rng.integers(0, vocab, prompt_len).tolist()
            if r == 1:
                start = {k: cm.manager.total_metrics() for k, cm in cached_models.items()}
            names = list(variants)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotate: no fixed slot
            results = {}
            for name in names:  # A B C ... then B C ... A, interleaved
                model, manager = variants[name]
                results[name] = result = generate(model, prompt, new_tokens, manager)
                if r > 0:
                    speeds[name].append(result.tokens_per_s)
            reference = results[STOCK].tokens
            for name, result in results.items():
                same_tokens[name] &= result.tokens == reference
        stock_tps = statistics.median(speeds[STOCK])
        rows, targets, per_miss_ok = [], [], True
        all_bytes = next(iter(cached_models.values())).manager.all_expert_bytes()
        rows.append(
            [STOCK, round(stock_tps, 1), _spread(speeds[STOCK]), 1.0, all_bytes, "", "", ""]
        )
        for (mode, cap), cm in cached_models.items():
            name = f"{mode} {int(cap * 100)}%"
            tps = statistics.median(speeds[name])
            m, s = cm.manager.total_metrics(), start[mode, cap]
            hits, reqs = m.hits - s.hits, m.requests - s.requests
            swaps, read = m.swaps - s.swaps, m.bytes_read - s.bytes_read
            nbytes = cm.manager.layers[0].expert_nbytes
            per_miss_ok &= read == swaps * nbytes and m.bytes_read == m.swaps * nbytes
            rows.append(
                [
                    name,
                    round(tps, 1),
                    _spread(speeds[name]),
                    round(tps / stock_tps, 3),
                    cm.manager.resident_expert_bytes(),
                    round(hits / reqs, 3),
                    swaps,
                    "yes" if same_tokens[name] else "no",
                ]
            )
            if cap == 1.0:
                targets.append(
                    {
                        "target": f"capacity 100% ({mode}): >= 0.9x the stock model's tokens/s",
                        "measured": f"{tps / stock_tps:.3f}x ({tps:.1f} vs {stock_tps:.1f} tokens/s)",
                        "met": tps / stock_tps >= 0.9,
                    }
                )
        nbytes = next(iter(cached_models.values())).manager.layers[0].expert_nbytes
        targets.append(
            {
                "target": "bytes read from disk per miss equal the expert's size exactly",
                "measured": f"bytes_read == swaps x {nbytes} B in every layer of every variant: "
                f"{per_miss_ok}",
                "met": per_miss_ok,
            }
        )
        for cm in cached_models.values():
            cm.store.close()
    c = config
    return write_result(
        "decode",
        "decode tokens/s and resident expert bytes vs the stock mlx-lm model",
        [
            "variant",
            "tokens/s (median)",
            "tokens/s (min-max)",
            "x stock",
            "resident expert bytes",
            "hit rate",
            "swaps",
            "same tokens as stock",
        ],
        rows,
        targets,
        f"Random Qwen3-MoE (mlx-lm classes): hidden {c['hidden_size']}, "
        f"{c['num_hidden_layers']} layers, {c['num_experts']} experts, top-{c['num_experts_per_tok']}, "
        f"expert size {c['moe_intermediate_size']}, 4-bit (group 64, float32 scales and activations), 4 shards. "
        f"Greedy decode of {new_tokens} tokens after a random {prompt_len}-token prompt, "
        f"{rounds} timed rounds after a warm-up round, variants interleaved in an order rotated "
        "every round; median tokens/s "
        "after the first token. Hit rate and swaps over the timed rounds. Shards are in the OS "
        "page cache (written just before), so a miss costs a memory copy, not a disk read. "
        "mlx[cpu] on a 2-core machine.",
        quick=quick,
    )


if __name__ == "__main__":
    import sys

    run("--quick" in sys.argv)
