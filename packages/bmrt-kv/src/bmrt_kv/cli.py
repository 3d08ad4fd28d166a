"""``bmrt-kv run``: read a file of any length through a bounded cache and answer a question.

The retrieval evaluation (``bmrt-kv eval`` before 0.11.0: the pass key and the
RULER-style suite's tasks) is not part of the wheel: it runs from a checkout of the
repository as ``python packages/bmrt-kv/benchmarks/retrieval.py``, with the same options.
"""

from __future__ import annotations

import argparse
import sys
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

#: Where the retrieval evaluation lives, relative to a checkout of the repository.
RETRIEVAL_SCRIPT = "packages/bmrt-kv/benchmarks/retrieval.py"


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """Add the cache flags ``run`` shares with ``benchmarks/retrieval.py``.

    Args:
        parser: the (sub)command's parser; gets ``--model`` and every
            :class:`BMRTConfig` flag but the budget and the selector.
    """
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
        "--seed", type=int, default=BMRTConfig.seed, help="LSH hyperplanes; retrieval.py's samples"
    )
    parser.add_argument(
        "--decode-block",
        type=int,
        default=BMRTConfig.decode_block,
        help="decoding steps compressed together (1: every step), at most the block size",
    )


def cache_config(args: argparse.Namespace, budget: int, selector: str) -> BMRTConfig:
    """The :class:`BMRTConfig` the flags of :func:`add_cache_args` describe.

    Args:
        args: the parsed flags.
        budget: ``B``, tokens kept per layer.
        selector: a name in :data:`bmrt_kv.SELECTORS`.

    Returns:
        The validated config.

    Raises:
        BMRTError: a flag that does not apply to ``selector``, or a bad value.
    """
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
        decode_block=args.decode_block,
    )


def load_model(model: str):
    """Load a causal LM and its tokenizer for the command line.

    Args:
        model: a transformers model directory, or a ``.gguf`` file (which transformers
            dequantises to float32; needs the ``gguf`` package).

    Returns:
        ``(model, tokenizer)``, the model in eval mode and float32.

    Raises:
        BMRTError: no such path, a file that is not ``.gguf``, or a directory without
            ``config.json``.
    """
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
    """The text around one user message in the tokenizer's chat template: the document is
    streamed inside a user turn and the question closes it, so an instruct model answers
    instead of continuing.

    Args:
        tokenizer: a transformers tokenizer.

    Returns:
        ``(before, after)`` the message, or ``("", "")`` for a model without a template.
    """
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    marker = "\x00MESSAGE\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    before, _, after = text.partition(marker)
    return before, after


def cmd_run(args) -> int:
    """``bmrt-kv run``: stream the file, ask the question, print the answer.

    Args:
        args: the parsed flags of the ``run`` subcommand.

    Returns:
        0 (errors raise).
    """
    from bmrt_kv.stream import BoundedStream

    config = cache_config(args, args.budget, args.selector)
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


def cmd_eval_moved(args) -> int:
    """``bmrt-kv eval``: the evaluation left the wheel; say where it is now.

    Args:
        args: ignored; any arguments get the same answer.

    Raises:
        BMRTError: always, naming the script to run from a checkout.
    """
    raise BMRTError(
        "`bmrt-kv eval` left the bmrt-kv wheel in 0.11.0 with the evaluation code it ran; "
        f"from a checkout of the repository, run `python {RETRIEVAL_SCRIPT}` with the same "
        "options (--model, --tasks, --lengths, --samples, --budgets, --selectors, ...)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``bmrt-kv`` command line.

    Returns:
        The parser; every option's default shows in ``--help``.
    """
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
    add_cache_args(run)
    run.set_defaults(handler=cmd_run)

    moved = commands.add_parser(
        "eval",
        help="moved out of the wheel in 0.11.0: run benchmarks/retrieval.py from a checkout",
        add_help=False,
    )
    moved.set_defaults(handler=cmd_eval_moved)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``bmrt-kv`` entry point; an expected failure is one line and exit status 2.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status, 0 on success.
    """
    parser = build_parser()
    # `eval` takes whatever follows it, to say where it moved instead of rejecting a flag.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "eval":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.handler(args)
    except (ValueError, OSError) as err:
        # Expected failures (bad values, missing files, a model that will not load): one
        # line, exit 2, as argparse reports a bad argument.
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
