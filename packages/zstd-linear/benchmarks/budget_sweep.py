"""The budget policy's sweep on SmolLM2-135M (float32): ms/token one token at a time with
0, 25, 50, 75 and 100% of the decoded Linear bytes pinned, against the plain model and
per_pass_prefetch, interleaved in each repeat (plain, prefetch, budgets, ...).

Every run's tokens must equal the plain model's. Per budget: the pinned bytes, the hit
rate of the last pass and the peak decoded (anonymous) bytes.

    python packages/zstd-linear/benchmarks/budget_sweep.py           # full, writes JSON
    python packages/zstd-linear/benchmarks/budget_sweep.py --quick   # smoke, prints only
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from end_to_end import aligned_plain_model, decode_steps

from zstd_linear import compress_model, compression_stats, reset_stats, set_policy
from zstd_linear.model import compressed_layers

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def run(quick: bool = False, repeats: int | None = None) -> dict | None:
    from membound_testing import chat_prompt

    n_tokens, default_repeats = (2, 1) if quick else (32, 3)
    repeats = repeats or default_repeats
    plain, tokenizer = aligned_plain_model()
    model, _ = aligned_plain_model()
    report = compress_model(model)
    total = sum(lyr.encoded.original_bytes for lyr in compressed_layers(model).values())
    ids = tokenizer(
        chat_prompt(tokenizer, "What is the capital of France?"), return_tensors="pt"
    ).input_ids
    runs = [("per_pass_prefetch", {})] + [
        (f"budget {round(f * 100)}%", {"budget_bytes": int(f * total)}) for f in FRACTIONS
    ]
    # torch's own threads and the decode threads share the cores: each run is timed with
    # torch at its default thread count and at one thread (the plain model too; the faster
    # plain is the baseline).
    default_threads = torch.get_num_threads()
    thread_counts = sorted({default_threads, 1}, reverse=True)
    times: dict[tuple[str, int], list[float]] = {}
    facts: dict[str, tuple] = {}
    try:
        for _ in range(repeats):
            for threads in thread_counts:
                torch.set_num_threads(threads)
                sec, ref_tokens = decode_steps(plain, ids, n_tokens)
                times.setdefault(("plain", threads), []).append(sec)
                for name, options in runs:
                    policy = "budget" if name.startswith("budget") else name
                    set_policy(model, policy, **options)
                    reset_stats(model)
                    sec, tokens = decode_steps(model, ids, n_tokens)
                    if tokens != ref_tokens:
                        raise AssertionError(f"{name}: tokens differ from the plain model")
                    times.setdefault((name, threads), []).append(sec)
                    live = model.zstd_linear_runtime.policy
                    stats = compression_stats(model)
                    facts[name] = (
                        getattr(live, "pinned_bytes", 0),
                        live.hit_rates[-1] if getattr(live, "hit_rates", None) else None,
                        stats.peak_decoded_bytes,
                    )
    finally:
        torch.set_num_threads(default_threads)
    med = statistics.median
    plain_tok = min(med(times[("plain", t)]) for t in thread_counts)
    rows = []
    for threads in thread_counts:
        tok = med(times[("plain", threads)])
        rows.append(
            [
                f"plain (uncompressed, aligned), torch {threads} thread(s)",
                "-",
                "-",
                round(tok * 1e3, 1),
                f"{tok / plain_tok:.2f}",
                "-",
            ]
        )
    for name, _ in runs:
        pinned, hit, peak = facts[name]
        for threads in thread_counts:
            tok = med(times[(name, threads)])
            rows.append(
                [
                    f"{name}, torch {threads} thread(s)",
                    round(pinned / 2**20, 1),
                    "-" if hit is None else f"{hit:.2f}",
                    round(tok * 1e3, 1),
                    f"{tok / plain_tok:.2f}",
                    round(peak / 2**20, 1),
                ]
            )

    def best(name):
        return min(med(times[(name, t)]) for t in thread_counts) / plain_tok

    half = best("budget 50%")
    targets = [
        {
            "target": "budget with 50% of the decoded bytes pinned, one token at a time: "
            "<= 2.5x plain ms/token (each at its faster torch thread count)",
            "measured": f"{half:.2f}x",
            "met": half <= 2.5,
        },
        {
            "target": "budget 100% ~ resident: <= 1.1x plain ms/token",
            "measured": f"{best('budget 100%'):.2f}x",
            "met": best("budget 100%") <= 1.1,
        },
    ]
    columns = [
        "run",
        "pinned MiB",
        "hit rate (last pass)",
        "ms/token",
        "x plain",
        "peak decoded MiB (anonymous)",
    ]
    title = (
        f"Budget sweep on SmolLM2-135M float32, {len(compressed_layers(model))} Linear "
        f"(ratio {report.ratio:.2f}, {total / 2**20:.0f} MiB decoded): {n_tokens} tokens, "
        "one at a time"
    )
    notes = (
        f"Medians of {repeats} interleaved repeats; every run's tokens equal the plain "
        "model's. Plain has its Linear weights in fresh (aligned) memory. Pinned layers are "
        "chosen by decode cost saved per byte; the rest streams with per_pass_prefetch "
        "(window 2), decoded by 2 threads; 'torch 1 thread(s)' runs torch.set_num_threads(1) "
        "for the model's own compute, so that torch's threads and the decode threads do not "
        "contend for the 2 cores. x plain: against the faster plain run. SmolLM2's weights "
        "come from a Q4_1 GGUF."
    )
    if quick:
        from common import markdown

        print(title)
        print(markdown(columns, rows))
        return None
    from common import write_result

    return write_result("budget_sweep", title, columns, rows, targets, notes)


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
