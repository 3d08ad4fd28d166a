"""The minimum hard memory limit at which each KV method still answers a long pass key.

Every method reads the same pass key (``--tokens`` of filler, the key at half depth) and
answers; each run is a fresh process in its own cgroup (the budget runner of
``membound_testing.budget``: a hard limit with swap off, the page cache dropped first)
and the smallest limit at which it answers the right key is bisected. A method that does
not answer the key even without a limit (most selectors at B=1024, 8k tokens) is bisected
on completing instead (any answer, each try's kept): the limit it needs to run at all, a
memory figure that says nothing of quality (the row's ``passes on`` column says which).
Until 2026-11-28 such a method had to give its unlimited answer again, which conflated
memory with reproducibility: in one run ``lsh`` gave another answer at a limit above its
own unlimited peak, where no limit binds, and so had no minimum at all (the other
answer's text was not kept, and the cause was not looked into; in the next run all seven
of its tries gave the same answer). Methods:

- ``full``: the full DynamicCache, prefilled in blocks of 512 tokens (the cheaper way to
  hold a full cache);
- ``SELECTOR`` or ``SELECTOR:query_aware``: bmrt-kv at ``--budget``;
- ``kvpress:PRESS``: kvpress's own pipeline (the whole context in one forward with the
  press hooked in), kept size ``--budget``, in the kvpress environment's interpreter.

Needs root (cgroups). Runs in the default environment, which holds the budget runner:

    hatch run python packages/bmrt-kv/benchmarks/min_limits.py --methods full keydiff

The target of #18: at 8k tokens every bmrt-kv selector's minimum limit is below the full
cache's and kvpress's best press's, by at least half the KV bytes it does not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PASS_KEY = 48213


def child(method: str, tokens: int, budget: int) -> None:
    """Answer the pass key with ``method``; prints the answer on the last line."""
    import torch
    from evaluation import passkey_sample

    from membound_testing import load_smollm2

    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    sample = passkey_sample(tokenizer, tokens, key=PASS_KEY, depth=0.5)
    if method.startswith("kvpress:"):
        from kvpress_baseline import answer, make_press, ratio_for
        from transformers import DynamicCache

        ids = tokenizer(sample.context, return_tensors="pt").input_ids
        question = tokenizer(sample.question, return_tensors="pt", add_special_tokens=False)
        cache = DynamicCache()
        press = make_press(method.split(":", 1)[1], ratio_for(budget, ids.shape[1]))
        with torch.inference_mode(), press(model):
            model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        text = answer(model, tokenizer, cache, ids.shape[1], question.input_ids, 8)
    else:
        from evaluation import run_sample

        from bmrt_kv import BMRTConfig

        config = None
        if method != "full":
            selector, _, scoring = method.partition(":")
            config = BMRTConfig(budget=budget, selector=selector, scoring=scoring or "agnostic")
        text = run_sample(model, tokenizer, sample, config)["output"]
    print(text, flush=True)


def interpreter(method: str) -> str:
    """The kvpress environment's python for kvpress methods, this one otherwise."""
    if not method.startswith("kvpress:"):
        return sys.executable
    found = subprocess.run(
        ["hatch", "env", "find", "kvpress"], capture_output=True, text=True, check=True
    )
    python = Path(found.stdout.strip()) / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no kvpress environment at {python}: run `hatch env create kvpress`")
    return str(python)


def measure(method: str, tokens: int, budget: int, resolution: int) -> dict:
    from membound_testing.budget.profiles import MiB
    from membound_testing.budget.runner import bisect_min_limit, run_limited

    command = [interpreter(method), __file__, "--child", method, "--tokens", str(tokens)]
    command += ["--budget", str(budget)]
    first = run_limited(command, 4096 * MiB)
    if not first.completed or not first.stdout.strip():
        return {
            "method": method,
            "unlimited": first.status,
            "output": first.stdout.strip()[-80:],
            "stderr": first.stderr.strip()[-400:],
        }
    timeout = max(90.0, 4 * first.wall_s)
    answered = str(PASS_KEY) in first.stdout
    unlimited_answer = first.stdout.strip()

    def passes(limit: int) -> tuple[bool, str]:
        result = run_limited(command, limit, timeout=timeout)
        if not result.completed:
            return False, result.status
        if answered:
            ok = str(PASS_KEY) in result.stdout
            return ok, "ok" if ok else "wrong answer"
        # A hard limit can stop or slow a run, never change what it computes: a run that
        # completes had the memory it needed. Its answer is kept all the same, since a
        # method can differ from itself run to run (see the module docstring).
        text = result.stdout.strip()
        if not text:
            return False, "no answer"
        if text == unlimited_answer:
            return True, "ok, same answer"
        return True, f"ok, another answer: {text.splitlines()[-1][:40]!r}"

    hi = (first.peak_usage // MiB + 32) * MiB
    found = bisect_min_limit(passes, 64 * MiB, hi, resolution * MiB)
    return {
        "method": method,
        "min_limit_mib": None if found.min_bytes is None else found.min_bytes // MiB,
        "peak_anon_mib": round(first.peak_anon / MiB, 1),
        "peak_usage_mib": round(first.peak_usage / MiB, 1),
        "wall_s": round(first.wall_s, 1),
        "passes_on": "the key" if answered else "completing",
        "output": unlimited_answer.splitlines()[-1][:40],
        "tries": [[limit // MiB, ok, status] for limit, ok, status in found.tries],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", nargs="+", default=["full", "keydiff"])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--budget", type=int, default=1024, help="B, kept tokens per layer")
    parser.add_argument("--resolution", type=int, default=16, help="MiB")
    parser.add_argument("--name", default="min_limits", help="results/<name>.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.tokens, args.budget)
        return

    from common import write_result

    load_start = os.getloadavg()[0]
    rows, raw = [], []
    for method in args.methods:
        start = time.perf_counter()
        entry = measure(method, args.tokens, args.budget, args.resolution)
        raw.append(entry)
        print(json.dumps(entry), f"{time.perf_counter() - start:.0f} s", flush=True)
        rows.append(
            [
                args.tokens,
                method,
                "-" if method == "full" else args.budget,
                entry.get("min_limit_mib", f"not run: unlimited run {entry.get('unlimited')}"),
                entry.get("peak_anon_mib", "-"),
                entry.get("peak_usage_mib", "-"),
                entry.get("passes_on", "-"),
                entry.get("output", ""),
            ]
        )
        write_result(
            args.name,
            f"Minimum hard memory limit, {args.tokens}-token pass key, SmolLM2-135M",
            [
                "tokens",
                "method",
                "B",
                "min limit MiB",
                "peak anon MiB (no limit)",
                "peak usage MiB (no limit)",
                "passes on",
                "answer",
            ],
            rows,
            [],
            command="hatch run python packages/bmrt-kv/benchmarks/min_limits.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            notes=f"Each method in a fresh process per try, in its own cgroup (hard limit, swap "
            f"off, page cache dropped first); bisected at {args.resolution} MiB resolution "
            "between 64 MiB and the run's own peak without a limit (+32 MiB); a try "
            "passes when it answers the right key within max(90 s, 4x the unlimited run's "
            "wall time), or, for a method whose unlimited run does not answer the key, when "
            "it completes (passes on: completing; a memory figure, not a quality one; each "
            "try's status says whether it gave the unlimited run's answer again). Torch 2 "
            "threads. Every try: "
            + json.dumps([{e["method"]: e.get("tries")} for e in raw])
            + f". 1-minute load average {load_start:.1f} at the start (2 cores).",
        )


if __name__ == "__main__":
    main()
