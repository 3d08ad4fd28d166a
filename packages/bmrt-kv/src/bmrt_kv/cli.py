"""``bmrt-kv run`` (read a file, answer a question) and ``bmrt-kv eval`` (pass-key retrieval
and the RULER-style suite's tasks)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bmrt_kv.config import (
    DEFAULT_BLOCK_SIZE,
    GRANULARITIES,
    POSITION_MODES,
    SCORING_MODES,
    BMRTConfig,
)
from bmrt_kv.errors import BMRTError
from bmrt_kv.selectors import SELECTORS, TIE_BREAKERS
from bmrt_kv.suite import TASKS


def _add_cache_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="a transformers model directory, or a .gguf file (dequantised to float32)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"tokens per prefill block; None: min({DEFAULT_BLOCK_SIZE}, budget), "
        f"query-aware min({DEFAULT_BLOCK_SIZE}, 2 x budget)",
    )
    parser.add_argument(
        "--divisor", type=int, default=BMRTConfig.protection_divisor, help="protection_divisor n"
    )
    parser.add_argument(
        "--scoring",
        choices=SCORING_MODES,
        default=BMRTConfig.scoring,
        help="query_aware also scores by --question",
    )
    parser.add_argument(
        "--positions",
        choices=POSITION_MODES,
        default=BMRTConfig.positions,
        help="rerotate: kept keys move to contiguous positions",
    )
    parser.add_argument(
        "--granularity",
        choices=GRANULARITIES,
        default=BMRTConfig.granularity,
        help="head: each KV head keeps its own tokens",
    )
    parser.add_argument(
        "--tie-breaker",
        choices=sorted(TIE_BREAKERS),
        default=None,
        help="lsh only (None: the selector's own default)",
    )
    parser.add_argument(
        "--kernel", type=int, default=None, help="max-pool width of exact / snapkv scores (odd)"
    )
    parser.add_argument(
        "--question-weight",
        type=float,
        default=BMRTConfig.question_weight,
        help="query-aware scoring: the question's share of the scoring weight, in (0, 1]",
    )
    parser.add_argument(
        "--seed", type=int, default=BMRTConfig.seed, help="LSH hyperplanes; eval's samples"
    )


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


def load_model(model: str):
    """(model, tokenizer) from a transformers model directory or a ``.gguf`` file (which
    transformers dequantises to float32; needs the ``gguf`` package)."""
    path = Path(model)
    if not path.exists():
        raise BMRTError(f"--model {model}: no such directory or .gguf file")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_file():
        if path.suffix != ".gguf":
            raise BMRTError(
                f"--model {model}: a file must be a .gguf model; otherwise pass the model's "
                "directory (config.json and weights)"
            )
        kwargs = {"gguf_file": path.name}
        path = path.parent
    else:
        if not (path / "config.json").is_file():
            raise BMRTError(f"--model {model}: the directory has no config.json")
        kwargs = {}
    loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32", **kwargs)
    return loaded.eval(), AutoTokenizer.from_pretrained(str(path), **kwargs)


def chat_frame(tokenizer) -> tuple[str, str]:
    """The text before and after one user message in the tokenizer's chat template, or
    ``("", "")`` for a model without one: the document is streamed inside a user turn
    and the question closes it, so an instruct model answers instead of continuing."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    marker = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    before, _, after = text.partition(marker)
    return before, after


def cmd_run(args) -> int:
    from bmrt_kv.stream import BoundedStream

    config = _config(args, args.budget, args.selector)
    source = Path(args.file)
    if not source.is_file():
        raise BMRTError(f"{args.file}: no such file to read")
    text = source.read_text(encoding="utf-8")
    model, tokenizer = load_model(args.model)
    before, after = chat_frame(tokenizer)
    question = args.question if config.scoring == "query_aware" else None
    with BoundedStream(model, tokenizer, config, question=question, progress=True) as stream:
        stream.feed(before + text + "\n\n")
        answer = stream.ask(args.question + after, args.max_new_tokens)
        stats = stream.stats
    if answer:
        print(answer)
    else:
        print(
            f"(no answer: the model's first token was end-of-text; try a longer "
            f"--max-new-tokens than {args.max_new_tokens} or a larger --budget)"
        )
    print(
        f"[{stats.prefill_tokens} tokens read at {stats.prefill_tokens_per_s:.0f} tok/s, "
        f"peak KV {stats.peak_kv_bytes / 2**20:.1f} MiB]",
        file=sys.stderr,
    )
    return 0


def cmd_eval(args) -> int:
    from tqdm.auto import tqdm

    from bmrt_kv.evaluation import passkey_samples, run_sample
    from bmrt_kv.suite import suite_samples

    runs = [("full", None, None)] if args.full else []
    runs += [(s, b, _config(args, b, s)) for s in args.selectors for b in args.budgets]
    model, tokenizer = load_model(args.model)
    rows = []
    # One bar over every sample of every run, so its ETA is the whole evaluation's.
    total = len(args.lengths) * len(args.tasks) * len(runs) * args.samples
    with tqdm(total=total, desc="eval", unit="sample") as bar:
        for n_tokens in args.lengths:
            suite = [t for t in args.tasks if t != "passkey"]
            by_task = suite_samples(tokenizer, n_tokens, args.samples, args.seed, suite)
            if "passkey" in args.tasks:
                by_task["passkey"] = passkey_samples(tokenizer, n_tokens, args.samples, args.seed)
            for task in args.tasks:
                samples = by_task[task]
                for name, budget, config in runs:
                    bar.set_postfix_str(f"{task} {name} B={budget} {n_tokens} tok")
                    results = []
                    for sample in samples:
                        results.append(
                            run_sample(
                                model,
                                tokenizer,
                                sample,
                                config,
                                args.block_size or DEFAULT_BLOCK_SIZE,
                            )
                        )
                        bar.update()
                    row = {
                        "task": task,
                        "tokens": n_tokens,
                        "selector": name,
                        "budget": budget,
                        "accuracy": sum(r["correct"] for r in results) / len(results),
                        "samples": len(results),
                    }
                    rows.append(row)
                    tqdm.write(json.dumps(row))
    if args.out:
        _write_json(Path(args.out), rows)
    return 0


def _write_json(path: Path, data) -> None:
    """Write ``data`` as JSON through a temporary file and a rename, so a killed run
    leaves no half-written file; the file gets the process's umask, not mkstemp's 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="bmrt-kv", description=__doc__, formatter_class=formatter)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="stream FILE through a bounded cache and answer", formatter_class=formatter
    )
    run.add_argument("file", help="a UTF-8 text file of any length")
    run.add_argument("--question", required=True, help="asked after the whole file is read")
    run.add_argument("--budget", type=int, default=1024, help="B, tokens kept per layer")
    run.add_argument(
        "--selector",
        choices=sorted(SELECTORS),
        default=BMRTConfig.selector,
        help="which tokens the long-term slots keep",
    )
    run.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit")
    _add_cache_args(run)
    run.set_defaults(handler=cmd_run)

    ev = commands.add_parser(
        "eval",
        help="retrieval accuracy, pass key or the RULER-style suite's tasks (long: every "
        "length x task x selector x budget x sample; the bar shows the whole run's ETA)",
        formatter_class=formatter,
    )
    ev.add_argument(
        "--tasks",
        nargs="+",
        choices=("passkey", *TASKS),
        default=["passkey"],
        help="passkey, or tasks of the RULER-style suite (bmrt_kv.suite), scored by exact match",
    )
    ev.add_argument(
        "--lengths", type=int, nargs="+", default=[2000, 4000, 7500], help="context tokens"
    )
    ev.add_argument("--samples", type=int, default=20, help="samples per task and length")
    ev.add_argument(
        "--budgets", type=int, nargs="+", default=[256, 512, 1024], help="B values to try"
    )
    ev.add_argument(
        "--selectors",
        nargs="+",
        choices=sorted(SELECTORS),
        default=sorted(SELECTORS),
        help="selectors to try",
    )
    ev.add_argument(
        "--full",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the full cache (the ceiling)",
    )
    ev.add_argument("--out", help="write the rows as JSON here")
    _add_cache_args(ev)
    ev.set_defaults(handler=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError) as err:
        # Expected failures (bad values, missing files, a model that will not load): one
        # line, exit 2, as argparse reports a bad argument.
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
