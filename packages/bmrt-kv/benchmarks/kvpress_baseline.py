"""kvpress's presses on the same pass-key samples, at the same final KV size as bmrt-kv.

Runs in its own environment (kvpress needs transformers < 5.3):
``hatch run kvpress:python packages/bmrt-kv/benchmarks/kvpress_baseline.py``.

This follows kvpress's own pipeline: the whole context is prefilled in one forward with
the press hooked in (each layer's cache is compressed right after its attention, so the
full-length cache of one layer and the full activations exist during prefill: the
peak is not bounded the way bmrt-kv's is), then the question is fed with position ids
continuing the original ones and the answer decoded greedily without compression.
``compression_ratio = 1 - B / context_tokens`` so each layer keeps B tokens, as bmrt-kv's
budget does. The question is not in the compressed context, so this is the
query-agnostic setting; compare it with bmrt-kv's ``agnostic`` rows.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import resource
import statistics
import sys
import time

import torch
from common import write_result

from bmrt_kv.evaluation import passkey_samples

PRESSES = ["streaming_llm", "snapkv", "tova", "expected_attention"]


def make_press(name: str, ratio: float):
    from kvpress import ExpectedAttentionPress, SnapKVPress, StreamingLLMPress, TOVAPress

    classes = {
        "streaming_llm": StreamingLLMPress,
        "snapkv": SnapKVPress,
        "tova": TOVAPress,
        "expected_attention": ExpectedAttentionPress,
    }
    return classes[name](compression_ratio=ratio)


@torch.inference_mode()
def run_sample(model, tokenizer, sample, press, max_new_tokens: int = 8) -> dict:
    from transformers import DynamicCache

    context = tokenizer(sample.context, return_tensors="pt").input_ids
    question = tokenizer(sample.question, return_tensors="pt", add_special_tokens=False).input_ids
    cache = DynamicCache()
    start = time.perf_counter()
    with press(model):
        model.model(input_ids=context, past_key_values=cache)
    prefill = time.perf_counter() - start
    kept = cache.get_seq_length()
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    n = context.shape[1]
    positions = torch.arange(n, n + question.shape[1]).unsqueeze(0)
    start = time.perf_counter()
    logits = model(
        input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1
    ).logits
    new: list[int] = []
    position = n + question.shape[1]
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        new.append(token)
        if token == tokenizer.eos_token_id:
            break
        logits = model(
            input_ids=torch.tensor([[token]]),
            past_key_values=cache,
            position_ids=torch.tensor([[position]]),
            logits_to_keep=1,
        ).logits
        position += 1
    decode = time.perf_counter() - start
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    return {
        "correct": sample.correct(text),
        "prefill_tokens_per_s": n / prefill,
        "decode_tokens_per_s": len(new) / decode,
        "kv_bytes": kv,
        "kept": kept,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[7500])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024])
    parser.add_argument("--presses", nargs="+", default=PRESSES, choices=PRESSES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    from membound_testing import load_smollm2

    model, tokenizer = load_smollm2()
    load_start = os.getloadavg()[0]
    rows = []
    for n_tokens in args.lengths:
        samples = passkey_samples(tokenizer, n_tokens, args.samples, args.seed)
        for budget in args.budgets:
            for name in args.presses:
                results = []
                for sample in samples:
                    n = len(tokenizer(sample.context).input_ids)
                    press = make_press(name, max(0.0, 1.0 - budget / n))
                    results.append(run_sample(model, tokenizer, sample, press))
                kept = {r["kept"] for r in results}
                row = [
                    n_tokens,
                    f"kvpress {name}",
                    budget,
                    "agnostic",
                    f"{sum(r['correct'] for r in results)}/{len(results)}",
                    round(statistics.median(r["prefill_tokens_per_s"] for r in results), 1),
                    round(statistics.median(r["decode_tokens_per_s"] for r in results), 1),
                    round(max(r["kv_bytes"] for r in results) / 2**20, 1),
                    f"{min(kept)}-{max(kept)}" if len(kept) > 1 else str(kept.pop()),
                ]
                rows.append(row)
                print(row, flush=True)
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                write_result(
                    "kvpress_baseline",
                    "kvpress presses on the same pass-key samples (same final KV size)",
                    [
                        "tokens",
                        "press",
                        "B",
                        "scoring",
                        "correct",
                        "prefill tok/s",
                        "decode tok/s",
                        "final KV MiB",
                        "kept tokens/layer",
                    ],
                    rows,
                    [],
                    command="hatch run kvpress:python packages/bmrt-kv/benchmarks/"
                    "kvpress_baseline.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    notes=f"kvpress {importlib.metadata.version('kvpress')}"
                    f" with transformers {transformers.__version__}; samples as bmrt-kv's "
                    f"passkey.py (seed {args.seed}). The whole context is prefilled at once "
                    "(kvpress's pipeline), so peak memory is the full cache of a layer plus "
                    f"the full activations; peak RSS of the run {rss / 2**20:.0f} MiB. "
                    f"1-minute load average {load_start:.1f} at the start and "
                    f"{os.getloadavg()[0]:.1f} at the last row (2 cores).",
                )


if __name__ == "__main__":
    main()
