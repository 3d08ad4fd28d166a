"""Where a bounded cache loses a suite task: the answer, or only its first token?

For each sample of one suite task, a :class:`~bmrt_kv.stream.BoundedStream` reads the
context and the question, and the answer is decoded twice, by two streams fed the same
input (deterministic: the same state): freely (what ``suite.py`` scores) and with its
first token forced to the full cache's first token (also computed here, on the same
sample). A sample that fails freely but passes
forced kept what the answer needs and lost only the choice of its first token, e.g. the
single-word task's ``: insect.`` (the needle's own format, which the full cache copies)
against ``"insect"``.

    hatch run bmrt-kv:python packages/bmrt-kv/benchmarks/first_token.py \\
        --task single_word --budget 256 --samples 20
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from common import write_result
from ruler_suite import TASKS, suite_samples

from bmrt_kv import BMRTConfig
from bmrt_kv.hooks import cache_keyword
from bmrt_kv.stream import BoundedStream

COLUMNS = ["sample", "answer", "full", "free", "forced first token", "free first token"]


@torch.inference_mode()
def full_first_token(model, tokenizer, sample, block_size: int = 512) -> int:
    """The full cache's first answer token (the context and question prefilled in blocks)."""
    from transformers import DynamicCache

    ids = tokenizer(sample.context + sample.question, return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    for block in ids.split(block_size, dim=-1):
        logits = model(input_ids=block, logits_to_keep=1, **{cache_keyword(model): cache}).logits
    return int(logits[0, -1].argmax())


@torch.inference_mode()
def bounded_answer(model, tokenizer, sample, config: BMRTConfig, first: int | None) -> list[int]:
    """The bounded stream's greedy answer, its first token forced to ``first`` if given."""
    question = sample.question if config.scoring == "query_aware" else None
    with BoundedStream(model, tokenizer, config, question=question) as stream:
        stream.feed(sample.context)
        if first is None:
            return stream.generate(sample.question, sample.max_new_tokens)
        stream.feed(sample.question)
        # The decoding step generate() would take with ``first`` as its argmax.
        stream._decode(first)
        return [first, *stream.generate(None, sample.max_new_tokens - 1)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="single_word", choices=TASKS)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default=None, help="results/<name>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from membound_testing import load_smollm2

    model, tokenizer = load_smollm2()
    load_start = os.getloadavg()[0]
    config = BMRTConfig(budget=args.budget, scoring="query_aware")
    samples = suite_samples(tokenizer, args.tokens, args.samples, args.seed, [args.task])
    rows = []
    for i, sample in enumerate(samples[args.task]):
        first = full_first_token(model, tokenizer, sample)
        free = bounded_answer(model, tokenizer, sample, config, None)
        forced = bounded_answer(model, tokenizer, sample, config, first)
        full = tokenizer.decode([first])
        free_first = tokenizer.decode(free[:1])
        free = tokenizer.decode(free, skip_special_tokens=True).strip()
        forced = tokenizer.decode(forced, skip_special_tokens=True).strip()
        rows.append(
            [i, sample.answer, full, sample.correct(free), sample.correct(forced), free_first]
        )
        print(rows[-1], repr(free[:40]), repr(forced[:40]), flush=True)
    n = len(rows)
    name = args.name or f"first_token_{args.task}_{args.budget}"
    write_result(
        name,
        f"bmrt-kv defaults (query-aware, B={args.budget}) on {args.task} at {args.tokens} "
        "tokens: free answer against the full cache's first token forced",
        COLUMNS,
        rows,
        [],
        command="hatch run bmrt-kv:python packages/bmrt-kv/benchmarks/first_token.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        notes=f"{n} samples (seed {args.seed}): correct freely "
        f"{sum(r[3] for r in rows)}/{n}, with the full cache's first token forced "
        f"{sum(r[4] for r in rows)}/{n}; the free first token equals the full cache's in "
        f"{sum(r[5] == r[2] for r in rows)}/{n}. 1-minute load average {load_start:.1f} at "
        f"the start, {os.getloadavg()[0]:.1f} at the end (2 cores).",
    )


if __name__ == "__main__":
    main()
