"""Retrieval accuracy of any model through the bounded cache: the pass key, or the
RULER-style suite's tasks (ruler_suite.py), by exact match; one row per task, length,
selector and budget, with the full cache as the ceiling. One progress bar over every
sample of every run, so its ETA is the whole evaluation's.

This was ``bmrt-kv eval`` before 0.11.0, with the same options; the evaluation code stays
out of the wheel. From a checkout of the repository:

    python packages/bmrt-kv/benchmarks/retrieval.py --model DIR_OR_GGUF \\
        --lengths 2000 4000 --samples 20 --budgets 256 512 1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from evaluation import passkey_samples, run_sample
from ruler_suite import TASKS, suite_samples

from bmrt_kv import SELECTORS
from bmrt_kv.cli import add_cache_args, cache_config, load_model
from bmrt_kv.config import DEFAULT_BLOCK_SIZE


def evaluate(args: argparse.Namespace) -> list[dict]:
    """Score every task x length x run (the full cache, then selector x budget).

    Args:
        args: the flags of :func:`build_parser`.

    Returns:
        One row per task, length, selector and budget: ``task``, ``tokens``, ``selector``,
        ``budget`` (None for the full cache), ``accuracy`` and ``samples``.
    """
    from tqdm.auto import tqdm

    runs = [("full", None, None)] if args.full else []
    runs += [(s, b, cache_config(args, b, s)) for s in args.selectors for b in args.budgets]
    model, tokenizer = load_model(args.model)
    rows = []
    total = len(args.lengths) * len(args.tasks) * len(runs) * args.samples
    with tqdm(total=total, desc="eval", unit="sample") as bar:
        for n_tokens in args.lengths:
            suite = [t for t in args.tasks if t != "passkey"]
            by_task = suite_samples(tokenizer, n_tokens, args.samples, args.seed, suite)
            if "passkey" in args.tasks:
                by_task["passkey"] = passkey_samples(tokenizer, n_tokens, args.samples, args.seed)
            for task in args.tasks:
                for name, budget, config in runs:
                    bar.set_postfix_str(f"{task} {name} B={budget} {n_tokens} tok")
                    results = []
                    for sample in by_task[task]:
                        block_size = args.block_size or DEFAULT_BLOCK_SIZE
                        results.append(run_sample(model, tokenizer, sample, config, block_size))
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
    return rows


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON through a temporary file and a rename, so a killed run
    leaves no half-written file; the file gets the process's umask, not mkstemp's 0600.

    Args:
        path: the file to write.
        data: anything ``json.dump`` takes.
    """
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
    """The command line: ``bmrt-kv eval``'s options before 0.11.0.

    Returns:
        The parser; every option's default shows in ``--help``.
    """
    parser = argparse.ArgumentParser(
        prog="retrieval.py",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=("passkey", *TASKS),
        default=["passkey"],
        help="passkey, or tasks of the RULER-style suite (ruler_suite.py), scored by exact match",
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[2000, 4000, 7500], help="context tokens"
    )
    parser.add_argument("--samples", type=int, default=20, help="samples per task and length")
    parser.add_argument(
        "--budgets", type=int, nargs="+", default=[256, 512, 1024], help="B values to try"
    )
    parser.add_argument(
        "--selectors",
        nargs="+",
        choices=sorted(SELECTORS),
        default=sorted(SELECTORS),
        help="selectors to try",
    )
    parser.add_argument(
        "--full",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the full cache (the ceiling)",
    )
    parser.add_argument("--out", help="write the rows as JSON here")
    add_cache_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation; a bad value or model is one line and exit status 2.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        0 when every run finished.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rows = evaluate(args)
        if args.out:
            write_json(Path(args.out), rows)
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
