"""A long stream with the needle early: bounded + rerotate past 8192 positions, peak RSS.

Each length runs in its own process (peak RSS is per process): SmolLM2-135M reads a
pass-key prompt of N tokens with the key at 5% depth through a B=1024 cache with
``positions="rerotate"`` and query-aware selection (``--selector``, exact by default),
then answers. SmolLM2 was trained to 8192 positions, so a full cache over 32k tokens puts queries and keys further
apart than it ever saw; the bounded cache never holds more than B + block tokens and
re-rotation keeps every query-key distance below that. Target: peak RSS at 32k within
10% of the peak at 4k.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from common import write_result


def child(n_tokens: int, budget: int, positions: str, selector: str) -> None:
    import torch
    from evaluation import passkey_sample, run_sample

    from bmrt_kv import BMRTConfig
    from membound_testing import load_smollm2

    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    sample = passkey_sample(tokenizer, n_tokens, key=73914, depth=0.05)
    config = BMRTConfig(
        budget=budget,
        block_size=512,
        selector=selector,
        scoring="query_aware",
        positions=positions,
    )
    start = time.perf_counter()
    result = run_sample(model, tokenizer, sample, config)
    result["seconds"] = time.perf_counter() - start
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4000, 32000])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument(
        "--absolute-at",
        type=int,
        nargs="*",
        default=[32000],
        help="lengths also run with positions='absolute', to show what rerotate buys",
    )
    parser.add_argument("--selector", default="exact")
    parser.add_argument("--name", default="stream_rss", help="results/<name>.json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--positions", default="rerotate", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.budget, args.positions, args.selector)
        return
    if args.quick:
        args.lengths, args.absolute_at = [4000, 8000], []
    load_start = os.getloadavg()[0]
    rows, peaks = [], {}
    runs = [(n, "rerotate") for n in args.lengths] + [(n, "absolute") for n in args.absolute_at]
    for n, positions in runs:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(n),
                "--budget",
                str(args.budget),
                "--positions",
                positions,
                "--selector",
                args.selector,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        result = json.loads(out.split("RESULT ", 1)[1])
        if positions == "rerotate":
            peaks[n] = result["peak_rss_bytes"]
        rows.append(
            [
                n,
                positions,
                result["output"],
                result["correct"],
                round(result["prefill_tokens_per_s"], 1),
                round(result["peak_kv_bytes"] / 2**20, 1),
                round(result["peak_rss_bytes"] / 2**20, 1),
            ]
        )
        print(rows[-1], flush=True)
    short, long = min(peaks), max(peaks)
    growth = peaks[long] / peaks[short] - 1
    target = {
        "target": "peak RSS over a 32k-token stream within 10% of the peak over 4k",
        "measured": f"{long} tokens: {peaks[long] / 2**20:.0f} MiB vs {short}: "
        f"{peaks[short] / 2**20:.0f} MiB ({growth:+.1%})",
        "met": long >= 32000 and short <= 4000 and growth <= 0.10,
    }
    write_result(
        args.name,
        f"Long stream, needle at 5%, B={args.budget}, query-aware {args.selector}",
        [
            "tokens",
            "positions",
            "answer",
            "correct",
            "prefill tok/s",
            "peak KV MiB",
            "peak RSS MiB",
        ],
        rows,
        [target],
        f"Lengths run: {args.lengths} with rerotate, {args.absolute_at} with absolute positions "
        "(one process each). Key 73914. The full cache is not run past 8192 tokens "
        "(SmolLM2's trained range; a 32k full cache would hold 1.4 GiB of KV). 1-minute load "
        f"average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 cores).",
    )


if __name__ == "__main__":
    main()
