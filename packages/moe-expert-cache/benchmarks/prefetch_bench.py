"""Speculative prefetch on the real MoE (MoEfied SmolLM2, top-4 of 16): hit rate, loads
and stall time per token, and decode tokens/s, with and without prefetch, at 25% and 50%
capacity, beside the stock fully resident model, interleaved in one run, on held-out text.

Stall time: the seconds the forward spends on expert loads (``LayerMetrics.stall_s``:
reads done in the forward, waits for the prefetch's read, slot writes), per decoded token.
"""

from __future__ import annotations

import os
import statistics
import time

import mlx.core as mx
import numpy as np
from _common import RESULTS, write_result
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, load_tokenizer
from smollm2_moe import smollm2_moe
from texts import texts

from moe_expert_cache import ExpertCacheConfig, load_cached_model

COMMAND = "hatch run moe-expert-cache:python packages/moe-expert-cache/benchmarks/prefetch_bench.py"
# The prose text is the one real_traces.py fits LCP's constants on; these two are held out
# from it (and, like every text of texts.py, from moefy's calibration text).
HELD_OUT = ("chat", "code")
CAPACITIES = (0.25, 0.5)  # 25% is 4 of 16: top-4 routing allows no fewer
STOCK = "stock (all experts resident)"
COUNTERS = ("requests", "hits", "swaps", "bytes_read", "prefetched", "prefetch_used", "stall_s")


def variant_name(capacity: float, prefetch: bool) -> str:
    return f"exact {capacity * 100:g}%, prefetch {'on' if prefetch else 'off'}"


def counters(manager) -> dict:
    total = manager.total_metrics()
    return {name: getattr(total, name) for name in COUNTERS}


def teacher_forced(model, ids: list[int], prompt_len: int, manager=None):
    """The prompt in one forward, then one forward per token of ``ids[prompt_len:-1]``.

    Returns each decode forward's seconds (call + evaluation), the process's CPU seconds
    over them (every thread), the decode logits, float32 (T, vocab), and the change of
    ``manager``'s counters over the decode forwards."""
    kv = make_prompt_cache(model)
    mx.eval(model(mx.array(ids[:prompt_len])[None], cache=kv))
    before = counters(manager) if manager else None
    seconds, logits, cpu = [], [], 0.0
    for t in ids[prompt_len:-1]:
        cpu_start, start = time.process_time(), time.perf_counter()
        out = model(mx.array([[t]]), cache=kv)[0, -1]
        mx.eval(out)
        seconds.append(time.perf_counter() - start)
        cpu += time.process_time() - cpu_start
        logits.append(np.array(out.astype(mx.float32)))
    if manager is None:
        return seconds, cpu, np.stack(logits), None
    after = counters(manager)
    return seconds, cpu, np.stack(logits), {c: after[c] - before[c] for c in COUNTERS}


def read_seconds(cached, reads: int) -> float:
    """Median seconds of one expert read from the shards (page cache warm): what a demand
    load costs the forward before its slot write."""
    layer = cached.manager.layers[1]
    times = []
    for i in range(reads):
        start = time.perf_counter()
        mx.eval(cached.store.read_expert(layer.block_path, i % layer.slots.num_experts))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(quick: bool = False, command: str = COMMAND, demo: bool = False) -> dict:
    """``demo``: the demo's build (``membound_testing.moefy.demo_config``, top-48 of 128) at
    50% and 75% (25%, 32 experts, cannot hold a token's 48), written as ``prefetch_demo``."""
    load_start = os.getloadavg()
    rounds, prompt_len, decode = (1, 16, 12) if quick else (3, 32, 64)
    capacities, result_name = CAPACITIES, "prefetch"
    if demo:
        from membound_testing.moefy import demo_config

        path, capacities, result_name = smollm2_moe(demo_config()), (0.5, 0.75), "prefetch_demo"
        if command == COMMAND:  # run as a script, not from run_all
            command += " --demo"
    else:
        path = smollm2_moe()
    tokenizer = load_tokenizer(path)
    corpus = {kind: tokenizer.encode(texts()[kind])[: prompt_len + decode + 1] for kind in HELD_OUT}
    stock, _ = load_model(path)
    models = {STOCK: (stock, None)}
    for cap in capacities:
        for prefetch in (False, True):
            cm = load_cached_model(
                path, ExpertCacheConfig(capacity_share=cap, mode="exact", prefetch=prefetch)
            )
            models[variant_name(cap, prefetch)] = (cm.model, cm)
    names = list(models)
    # Per (variant, text): per-round decode seconds per token, stall, counter deltas.
    runs = {(n, k): [] for n in names for k in HELD_OUT}
    max_diff = dict.fromkeys(names, 0.0)
    reference = {kind: teacher_forced(stock, ids, prompt_len)[2] for kind, ids in corpus.items()}
    for r in range(rounds + 1):  # round 0 warms every variant up and is not kept
        order = names[r % len(names) :] + names[: r % len(names)]  # A B C ..., rotated
        for kind, ids in corpus.items():
            for name in order:
                model, cm = models[name]
                seconds, cpu, logits, delta = teacher_forced(
                    model, ids, prompt_len, cm.manager if cm else None
                )
                if r == 0:
                    diff = float(np.abs(logits - reference[kind]).max())
                    max_diff[name] = max(max_diff[name], diff)
                else:
                    runs[name, kind].append((seconds, cpu, delta))
    expert_nbytes = models[names[1]][1].manager.layers[0].expert_nbytes
    one_read = read_seconds(models[names[1]][1], 20 if quick else 200)
    load_end = os.getloadavg()

    def summary(name, kind):
        per_round = runs[name, kind]
        tps = [len(s) / sum(s) for s, _, _ in per_round]
        out = {
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_all": tps,
            "cpu_per_wall": statistics.median(c / sum(s) for s, c, _ in per_round),
        }
        if per_round[0][2] is None:
            return out
        tokens = sum(len(s) for s, _, _ in per_round)
        total = {c: sum(d[c] for _, _, d in per_round) for c in COUNTERS}
        stall = [d["stall_s"] / len(s) for s, _, d in per_round]
        out.update(
            hit_rate=total["hits"] / total["requests"],
            reads_per_token=total["bytes_read"] / expert_nbytes / tokens,
            demand_reads_per_token=(total["swaps"] - total["prefetch_used"]) / tokens,
            prefetched_per_token=total["prefetched"] / tokens,
            guess_used=total["prefetch_used"] / total["prefetched"]
            if total["prefetched"]
            else None,
            stall_ms=statistics.median(stall) * 1e3,
            stall_ms_all=[s * 1e3 for s in stall],
        )
        return out

    results = {(n, k): summary(n, k) for n in names for k in HELD_OUT}
    rows, targets = [], []
    for kind in HELD_OUT:
        stock_tps = results[STOCK, kind]["tokens_per_s"]
        cpu = round(results[STOCK, kind]["cpu_per_wall"], 2)
        rows.append([kind, STOCK, "", "", "", "", "", "0", round(stock_tps, 2), 1.0, cpu, "yes"])
        for cap in capacities:
            for prefetch in (False, True):
                name = variant_name(cap, prefetch)
                s = results[name, kind]
                rows.append(
                    [
                        kind,
                        name,
                        round(s["hit_rate"], 4),
                        round(s["reads_per_token"], 2),
                        round(s["demand_reads_per_token"], 2),
                        round(s["prefetched_per_token"], 2),
                        "" if s["guess_used"] is None else round(s["guess_used"], 3),
                        f"{s['stall_ms']:.2f} ({min(s['stall_ms_all']):.2f}-"
                        f"{max(s['stall_ms_all']):.2f})",
                        round(s["tokens_per_s"], 2),
                        round(s["tokens_per_s"] / stock_tps, 3),
                        round(s["cpu_per_wall"], 2),
                        "yes" if max_diff[name] <= 1e-5 else f"no ({max_diff[name]:.2g})",
                    ]
                )
            off = results[variant_name(cap, False), kind]
            on = results[variant_name(cap, True), kind]
            targets.append(
                {
                    "target": f"{kind}, {cap * 100:g}% capacity: stall time per token with "
                    "prefetch below without it",
                    "measured": f"{on['stall_ms']:.2f} vs {off['stall_ms']:.2f} ms per token "
                    f"({on['stall_ms'] / off['stall_ms']:.2f}x); hit rate {on['hit_rate']:.4f} "
                    f"vs {off['hit_rate']:.4f}",
                    "met": on["stall_ms"] < off["stall_ms"],
                }
            )
    exact = all(max_diff[n] <= 1e-5 for n in names if n != STOCK)
    targets.append(
        {
            "target": "exact mode, with and without prefetch: logits equal stock's (<= 1e-5)",
            "measured": ", ".join(f"{n}: {max_diff[n]:.2g}" for n in names if n != STOCK),
            "met": exact,
        }
    )
    layout = (
        "Qwen2-MoE, 30 MoE layers, a shared expert of 1,152 neurons and 128 routed experts of "
        "3, top-48"
        if demo
        else "Mixtral, 30 MoE layers, 16 experts of 96 neurons, top-4"
    )
    notes = (
        f"Model: {path.name} (SmolLM2-135M-Instruct MoEfied, {layout}, float32, expert size "
        f"{expert_nbytes} B). Held-out "
        f"texts of benchmarks/texts.py: {', '.join(HELD_OUT)} (LCP's constants are fitted on "
        f"prose in real_traces.py; here the default lcp policy with the design's constants "
        f"runs). Each variant keeps its cache across texts and rounds and is fed the same "
        f"tokens: per text, a fresh KV cache, the first {prompt_len} tokens in one forward, "
        f"then {decode} tokens teacher-forced one forward each (decode). {rounds} rounds after "
        "a warm-up round, variants interleaved in an order rotated every round; hit rate, "
        "reads and prefetches over the kept rounds; stall ms per token and tokens/s: the "
        "median of the rounds (min-max). Hit rate: requests whose expert was resident or "
        "prefetched when the layer computed. Reads per token: experts read from the shards "
        "(demand reads + every prefetch); guess used: the share of prefetched experts the "
        "layer asked for (the others are dropped). Stall: time in the forward's expert "
        "loads (reads in the forward, waits for the prefetch thread, slot writes). Logits "
        "compared with stock's in the warm-up round. CPU s / wall s: the process's CPU time "
        "(every thread) over the decode forwards' wall time, median of the rounds (2: both "
        "cores busy the whole time). One expert read (CRC-32 + copy, page "
        f"cache warm) takes {one_read * 1e3:.3f} ms (median of {20 if quick else 200}). "
        "Shards in the OS page cache, so a read is a memory copy, not a disk read. "
        f"mlx[cpu] {mx.__version__}. 1-minute load average {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end (2 cores)."
    )
    result = write_result(
        result_name,
        "speculative prefetch on the real MoE (MoEfied SmolLM2): stall time per token",
        [
            "text",
            "variant",
            "hit rate",
            "expert reads / token",
            "demand reads / token",
            "prefetched / token",
            "guess used",
            "stall ms / token (min-max)",
            "tokens/s",
            "x stock",
            "CPU s / wall s",
            "logits = stock",
        ],
        rows,
        targets,
        notes,
        quick=quick,
        command=command,
    )
    if not quick:
        from membound_testing.results import write_json_atomic

        result["loadavg_start"], result["loadavg_end"] = list(load_start), list(load_end)
        result["one_expert_read_ms"] = one_read * 1e3
        result["per_round"] = {
            f"{n}/{k}": {
                key: results[n, k].get(key) for key in ("tokens_per_s_all", "stall_ms_all")
            }
            for n in names
            for k in HELD_OUT
        }
        write_json_atomic(RESULTS / f"{result_name}.json", result)
    return result


if __name__ == "__main__":
    import sys

    run("--quick" in sys.argv, demo="--demo" in sys.argv)
