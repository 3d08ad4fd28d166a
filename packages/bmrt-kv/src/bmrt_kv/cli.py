"""``bmrt-kv run`` (read a file, answer a question) and ``bmrt-kv eval`` (pass-key retrieval)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bmrt_kv.config import GRANULARITIES, POSITION_MODES, SCORING_MODES, BMRTConfig
from bmrt_kv.errors import BMRTError
from bmrt_kv.selectors import SELECTORS, TIE_BREAKERS


def _add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local model directory (transformers)")
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--divisor", type=int, default=8, help="protection_divisor n")
    parser.add_argument("--scoring", choices=SCORING_MODES, default="agnostic")
    parser.add_argument("--positions", choices=POSITION_MODES, default="absolute")
    parser.add_argument("--granularity", choices=GRANULARITIES, default="head")
    parser.add_argument("--tie-breaker", choices=sorted(TIE_BREAKERS), default=None)
    parser.add_argument(
        "--kernel", type=int, default=None, help="max-pool width of exact / snapkv scores (odd)"
    )
    parser.add_argument(
        "--question-weight",
        type=float,
        default=0.5,
        help="query-aware scoring: the question's share of the scoring weight, in (0, 1]",
    )
    parser.add_argument("--seed", type=int, default=0)


def _config(args, budget: int, selector: str) -> BMRTConfig:
    options = {}
    if args.tie_breaker is not None:
        if selector != "lsh":
            raise BMRTError(f"--tie-breaker applies to the lsh selector, not {selector!r}")
        options["tie_breaker"] = args.tie_breaker
    if args.kernel is not None:
        if selector not in ("exact", "snapkv"):
            raise BMRTError(f"--kernel applies to the exact and snapkv selectors, not {selector!r}")
        options["kernel"] = args.kernel
    return BMRTConfig(
        budget=budget,
        protection_divisor=args.divisor,
        block_size=args.block_size,
        selector=selector,
        selector_options=options,
        scoring=args.scoring,
        question_weight=args.question_weight,
        positions=args.positions,
        granularity=args.granularity,
        seed=args.seed,
    )


def _load(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _run(args) -> int:
    from bmrt_kv.stream import BoundedStream

    config = _config(args, args.budget, args.selector)
    text = Path(args.file).read_text(encoding="utf-8")
    model, tokenizer = _load(args.model)
    question = args.question if config.scoring == "query_aware" else None
    stream = BoundedStream(model, tokenizer, config, question=question, progress=True)
    stream.feed(text + "\n")
    print(stream.ask(args.question, args.max_new_tokens))
    stats = stream.stats
    print(
        f"[{stats.prefill_tokens} tokens read at {stats.prefill_tokens_per_s:.0f} tok/s, "
        f"peak KV {stats.peak_kv_bytes / 2**20:.1f} MiB]",
        file=sys.stderr,
    )
    return 0


def _eval(args) -> int:
    from tqdm.auto import tqdm

    from bmrt_kv.evaluation import passkey_samples, run_sample

    model, tokenizer = _load(args.model)
    runs = [("full", None, None)] if args.full else []
    runs += [(s, b, _config(args, b, s)) for s in args.selectors for b in args.budgets]
    rows = []
    for n_tokens in args.lengths:
        samples = passkey_samples(tokenizer, n_tokens, args.samples, args.seed)
        for name, budget, config in runs:
            results = [
                run_sample(model, tokenizer, s, config, args.block_size)
                for s in tqdm(samples, desc=f"{name} B={budget} {n_tokens} tok", unit="sample")
            ]
            row = {
                "tokens": n_tokens,
                "selector": name,
                "budget": budget,
                "accuracy": sum(r["correct"] for r in results) / len(results),
                "samples": len(results),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        _write_json(Path(args.out), rows)
    return 0


def _write_json(path: Path, data) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bmrt-kv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="stream FILE through a bounded cache and answer")
    run.add_argument("file")
    run.add_argument("--question", required=True)
    run.add_argument("--budget", type=int, default=1024)
    run.add_argument("--selector", choices=sorted(SELECTORS), default="exact")
    run.add_argument("--max-new-tokens", type=int, default=64)
    _add_cache_args(run)

    ev = commands.add_parser("eval", help="pass-key retrieval accuracy")
    ev.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 7500])
    ev.add_argument("--samples", type=int, default=20)
    ev.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ev.add_argument("--selectors", nargs="+", choices=sorted(SELECTORS), default=sorted(SELECTORS))
    ev.add_argument("--full", action=argparse.BooleanOptionalAction, default=True)
    ev.add_argument("--out", help="write the rows as JSON here")
    _add_cache_args(ev)

    args = parser.parse_args(argv)
    try:
        return _run(args) if args.command == "run" else _eval(args)
    except ValueError as err:
        parser.error(str(err))
    return 2


if __name__ == "__main__":
    sys.exit(main())
