"""Shared by the benchmarks: the JSON result format and its markdown table."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
COMMAND = "hatch run bmrt-kv:bench"
# These selectors ignore the queries: their scoring mode changes nothing.
QUERY_FREE = {"streaming"}


def add_run_flags(parser) -> None:
    """The flags passkey.py and suite.py share: threads, selector options, --append."""
    from bmrt_kv.selectors.tiebreak import TIE_BREAKERS

    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--kernel", type=int, default=None, help="max-pool width for exact and snapkv (odd)"
    )
    parser.add_argument(
        "--tie-breaker",
        default=None,
        choices=list(TIE_BREAKERS),
        help="the lsh selector's tie-breaker (default: the selector's, l2)",
    )
    parser.add_argument(
        "--question-share",
        type=float,
        default=None,
        help="keydiff's question_share: the share of its slots the question picks under "
        "query-aware scoring (default: the selector's, 0.5)",
    )
    parser.add_argument(
        "--anchor",
        default=None,
        choices=["pool", "stream"],
        help="keydiff's anchor: the mean key of the pool (default) or of the whole stream",
    )
    parser.add_argument(
        "--question-weight",
        type=float,
        default=0.5,
        help="query-aware rows: the question's share of the scoring weight, in (0, 1]",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the rows to results/<name>.json instead of replacing it",
    )


def runs(selectors, budgets, scorings) -> list[tuple]:
    """(selector, budget, scoring) to run: the full cache first if asked, and no
    query-aware run of a query-free selector."""
    out = [("full", None, "-")] if "full" in selectors else []
    out += [
        (selector, budget, scoring)
        for selector in selectors
        if selector != "full"
        for budget in budgets
        for scoring in scorings
        if not (selector in QUERY_FREE and scoring == "query_aware")
    ]
    return out


def block_label(config) -> str:
    """The label suffix of a config's block size: "" for the 512-token block (or the full
    cache, ``config=None``), " (block N)" otherwise, as every results file labels rows."""
    from bmrt_kv.config import DEFAULT_BLOCK_SIZE

    if config is None or config.block_tokens == DEFAULT_BLOCK_SIZE:
        return ""
    return f" (block {config.block_tokens})"


def run_config(args, selector: str, budget, scoring: str, block_size: int | None = None):
    """The BMRTConfig of one run (None for the full cache) from the shared flags, and the
    selector and scoring labels of its row. ``block_size=None`` takes the config's default,
    min(512, budget); a block other than 512 shows in the selector label ("keydiff (block
    256)"), as every results file has labelled it, so rows of the same label compare."""
    from bmrt_kv import BMRTConfig

    options = {}
    if args.kernel is not None and selector in ("exact", "snapkv"):
        options["kernel"] = args.kernel
    if args.tie_breaker is not None and selector == "lsh":
        options["tie_breaker"] = args.tie_breaker
    if args.question_share is not None and selector == "keydiff":
        options["question_share"] = args.question_share
    if args.anchor is not None and selector == "keydiff":
        options["anchor"] = args.anchor
    config = None
    if selector != "full":
        config = BMRTConfig(
            budget=budget,
            block_size=block_size,
            selector=selector,
            selector_options=options,
            scoring=scoring,
            question_weight=args.question_weight,
        )
    # snapkv scores with its observation window and ignores query weights.
    weighted = scoring == "query_aware" and args.question_weight != 0.5 and selector != "snapkv"
    return (
        config,
        selector
        + "".join(f" ({v})" if k == "tie_breaker" else f" ({k} {v})" for k, v in options.items())
        + block_label(config),
        scoring + (f" (question {args.question_weight})" if weighted else ""),
    )


def earlier_result(name: str, append: bool) -> dict | None:
    """results/<name>.json when ``--append`` asks to add to it, else None."""
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if append and path.is_file() else None


def write_result(name: str, title: str, columns, rows, targets, notes: str, command=COMMAND):
    """results/<name>.json through membound's one results writer (atomic), and its table;
    returns the path."""
    from membound_testing.results import write_result as write

    write(
        RESULTS,
        package="bmrt-kv",
        name=name,
        title=title,
        command=command,
        columns=columns,
        rows=rows,
        targets=targets,
        notes=notes,
    )
    return RESULTS / f"{name}.json"
