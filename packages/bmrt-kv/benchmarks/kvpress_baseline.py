"""kvpress's presses on the same pass-key samples, at the same final KV size as bmrt-kv.

Runs in its own environment (kvpress needs transformers < 5.3):
``hatch run kvpress:python packages/bmrt-kv/benchmarks/kvpress_baseline.py``.

This follows kvpress's own pipeline: the whole context is prefilled in one forward with
the press hooked in (each layer's cache is compressed right after its attention, so the
full-length cache of one layer and the full activations exist during prefill: the
peak is not bounded the way bmrt-kv's is), then the question is fed with position ids
continuing the original ones and the answer decoded greedily without compression.
``compression_ratio = 1 - B / context_tokens`` so each layer keeps B tokens, as bmrt-kv's
budget does.

Two modes (``--modes``): ``agnostic`` compresses the context alone and feeds the question
after it, uncompressed; ``query_aware`` compresses the context with the question appended
(kvpress's ``compress_questions``: the press sees the question) and answers from there.
``--tasks`` runs the RULER-style suite (``bmrt_kv.suite``) instead of the pass key, and
writes ``results/kvpress_suite.json`` with a task column.
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
from bmrt_kv.suite import TASKS, suite_samples

PRESSES = ["streaming_llm", "snapkv", "tova", "expected_attention", "keydiff"]


def make_press(name: str, ratio: float):
    from kvpress import (
        ExpectedAttentionPress,
        KeyDiffPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    classes = {
        "keydiff": KeyDiffPress,
        "streaming_llm": StreamingLLMPress,
        "snapkv": SnapKVPress,
        "tova": TOVAPress,
        "expected_attention": ExpectedAttentionPress,
    }
    return classes[name](compression_ratio=ratio)


@torch.inference_mode()
def run_sample(model, tokenizer, sample, press, query_aware: bool = False) -> dict:
    from transformers import DynamicCache

    max_new_tokens = sample.max_new_tokens
    text = sample.context + (sample.question if query_aware else "")
    context = tokenizer(text, return_tensors="pt").input_ids
    question = tokenizer(sample.question, return_tensors="pt", add_special_tokens=False).input_ids
    cache = DynamicCache()
    start = time.perf_counter()
    with press(model):
        logits = model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits
    prefill = time.perf_counter() - start
    kept = cache.get_seq_length()
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    n = context.shape[1]
    start = time.perf_counter()
    if not query_aware:
        positions = torch.arange(n, n + question.shape[1]).unsqueeze(0)
        logits = model(
            input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1
        ).logits
        n += question.shape[1]
    new: list[int] = []
    position = n
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
        "output": text,
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
    parser.add_argument(
        "--modes", nargs="+", default=["agnostic"], choices=["agnostic", "query_aware"]
    )
    parser.add_argument(
        "--tasks", nargs="+", default=None, choices=TASKS, help="suite tasks (default: pass key)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from membound_testing import load_smollm2

    model, tokenizer = load_smollm2()
    load_start = os.getloadavg()[0]
    rows = []
    for n_tokens in args.lengths:
        if args.tasks:
            by_task = suite_samples(tokenizer, n_tokens, args.samples, args.seed, args.tasks)
        else:
            by_task = {"passkey": passkey_samples(tokenizer, n_tokens, args.samples, args.seed)}
        for task, samples in by_task.items():
            for mode in args.modes:
                for budget in args.budgets:
                    for name in args.presses:
                        rows.append(_run(model, tokenizer, samples, name, n_tokens, budget, mode))
                        if args.tasks:
                            rows[-1].insert(1, task)
                        print(rows[-1], flush=True)
                        _write(args, argv, rows, load_start)


def _run(model, tokenizer, samples, name, n_tokens, budget, mode) -> list:
    results = []
    for sample in samples:
        text = sample.context + (sample.question if mode == "query_aware" else "")
        n = len(tokenizer(text).input_ids)
        press = make_press(name, max(0.0, 1.0 - budget / n))
        results.append(run_sample(model, tokenizer, sample, press, mode == "query_aware"))
    kept = {r["kept"] for r in results}
    return [
        n_tokens,
        f"kvpress {name}",
        budget,
        mode,
        f"{sum(r['correct'] for r in results)}/{len(results)}",
        round(statistics.median(r["prefill_tokens_per_s"] for r in results), 1),
        round(statistics.median(r["decode_tokens_per_s"] for r in results), 1),
        round(max(r["kv_bytes"] for r in results) / 2**20, 1),
        f"{min(kept)}-{max(kept)}" if len(kept) > 1 else str(kept.pop()),
    ]


def _write(args, argv, rows, load_start) -> None:
    """Rewrite the JSON after every configuration, so a cut-off run keeps what it measured."""
    import transformers

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    columns = [
        "tokens",
        "press",
        "B",
        "scoring",
        "correct",
        "prefill tok/s",
        "decode tok/s",
        "final KV MiB",
        "kept tokens/layer",
    ]
    if args.tasks:
        columns.insert(1, "task")
    write_result(
        "kvpress_suite" if args.tasks else "kvpress_baseline",
        "kvpress presses on the same samples as bmrt-kv (same final KV size)",
        columns,
        rows,
        [],
        command="hatch run kvpress:python packages/bmrt-kv/benchmarks/kvpress_baseline.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        notes=f"kvpress {importlib.metadata.version('kvpress')} with transformers "
        f"{transformers.__version__}; samples as bmrt-kv's "
        + ("suite.py" if args.tasks else "passkey.py")
        + f" (seed {args.seed}); modes {args.modes}. The whole context is prefilled at once "
        "(kvpress's pipeline), so peak memory is the full cache of a layer plus the full "
        f"activations; peak RSS of the run {rss / 2**20:.0f} MiB. 1-minute load average "
        f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the last row "
        "(2 cores).",
    )


if __name__ == "__main__":
    main()
