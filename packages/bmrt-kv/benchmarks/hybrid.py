"""bmrt-kv on a hybrid model with real weights: pass keys and the minimum hard limit.

The model: SmolLM2-135M-Instruct's own weights in a Qwen2 config whose layers mix sliding
window and full attention (``hybrid_dir``). Qwen2 is SmolLM2's architecture plus q/k/v
biases (zeroed here) and per-layer ``layer_types``; with the same sizes, rope and tied
embeddings, SmolLM2's state dict loads into it unchanged (on a prompt shorter than the
window its logits equal SmolLM2's). The default ``--pattern``: the first 6 of the 30
layers slide over a ``--window`` of 512 tokens (Gemma 3's smallest window), the other 24
attend to everything. Interleaved patterns, as real hybrids use them, lost every key
farther back than the window with the model's own cache at 4k tokens: Gemma 2's
alternating "SF" (window 512 and 2048), "FFS" and "FFFFFS" (Gemma 3's "SSSSSF" has more
sliding layers still and was not tried). The weights were trained with full attention in
every layer, and on such a model "found wherever the own cache finds it" would only test
keys inside the window; the first 6 or the last 6 layers sliding (or the first 2) still
found a key at depth 0.1 (2026-12-03, one key each, window 512). The
model is saved once under membound's cache directory (written under a temporary name,
then renamed) and loaded from there.

Accuracy (the default mode): pass-key prompts of ``--tokens`` tokens at each ``--depths``
and ``--keys``, answered greedily by ``model.generate`` with the model's own cache
(``DynamicCache(config=...)``: full layers grow, sliding layers keep their window) and
with ``BMRTCache`` at each ``--budgets``, both prefilled in chunks of 512 tokens
(``prefill_chunk_size``, as the README's example). A row per prompt and method: the key
found or not, and the KV bytes each cache holds at the end (and BMRTCache's peak).

``--min-limits``: the smallest cgroup memory limit at which each method still answers the
key (48213 at ``--depth``, 0.1 by default: the own cache found it there, not at 0.5),
bisected by the budget runner (needs root; run from the default environment, which holds
it; the child runs in the bmrt-kv environment's interpreter). The runner refuses while
any process maps a file under ``$MEMBOUND_CACHE``; the child maps only the hybrid model's
directory, so pointing ``MEMBOUND_CACHE`` at a directory that holds the hybrid model alone
lets it measure while other processes use SmolLM2's copy::

    hatch run bmrt-kv:python packages/bmrt-kv/benchmarks/hybrid.py
    MEMBOUND_CACHE=~/.cache/membound-hybrid hatch run bmrt-kv:python \\
        packages/bmrt-kv/benchmarks/hybrid.py --build-only \\
        --source ~/.cache/membound/smollm2-135m-instruct-f32-v1-98362432
    MEMBOUND_CACHE=~/.cache/membound-hybrid hatch run python \\
        packages/bmrt-kv/benchmarks/hybrid.py --min-limits
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HYBRID_FORMAT = 1  # bump when the saved hybrid model's layout changes
PREFILL_CHUNK = 512
MIN_LIMIT_KEY = 48213


def layer_types(n_layers: int, pattern: str) -> list[str]:
    """``pattern`` of S (sliding) and F (full) repeated over the layers: "SF" alternates as
    Gemma 2, "SSSSSF" is Gemma 3's five sliding layers to one full."""
    if not pattern or set(pattern) - {"S", "F"}:
        raise SystemExit(f"--pattern must be letters S and F, got {pattern!r}")
    kinds = {"S": "sliding_attention", "F": "full_attention"}
    return [kinds[pattern[i % len(pattern)]] for i in range(n_layers)]


def hybrid_dir(window: int, pattern: str, source: Path | None = None) -> Path:
    """The saved hybrid SmolLM2 (made on first use from ``source``, SmolLM2's float copy,
    by default ``membound_testing.models.smollm2_float_dir()``)."""
    from membound_testing.models import cache_dir, write_dir_atomic

    target = cache_dir() / f"smollm2-135m-hybrid-qwen2-w{window}-{pattern}-v{HYBRID_FORMAT}"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    import torch
    from transformers import (
        AutoModelForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if source is None:
        from membound_testing.models import smollm2_float_dir

        source = smollm2_float_dir()
    llama = AutoModelForCausalLM.from_pretrained(str(source), dtype="float32")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(source))
    lc = llama.config
    if lc.model_type != "llama":
        raise SystemExit(f"{source}: expected SmolLM2's llama config, got {lc.model_type!r}")
    config = Qwen2Config(
        vocab_size=lc.vocab_size,
        hidden_size=lc.hidden_size,
        intermediate_size=lc.intermediate_size,
        num_hidden_layers=lc.num_hidden_layers,
        num_attention_heads=lc.num_attention_heads,
        num_key_value_heads=lc.num_key_value_heads,
        hidden_act=lc.hidden_act,
        max_position_embeddings=lc.max_position_embeddings,
        rms_norm_eps=lc.rms_norm_eps,
        rope_parameters=dict(lc.rope_parameters),
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=lc.num_hidden_layers,
        layer_types=layer_types(lc.num_hidden_layers, pattern),
        bos_token_id=lc.bos_token_id,
        eos_token_id=lc.eos_token_id,
        pad_token_id=lc.pad_token_id,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    biases = [k for k in missing if not k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    if biases or unexpected:
        raise SystemExit(f"SmolLM2 -> Qwen2: missing {biases}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in missing:
                param.zero_()

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return write_dir_atomic(target, write)


def load_hybrid(window: int, pattern: str, source: Path | None = None):
    """(model, tokenizer) of the hybrid SmolLM2, offline, in eval mode."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = hybrid_dir(window, pattern, source)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    return model, tokenizer


def kv_held(cache) -> int:
    """Bytes of keys and values a transformers cache holds now, every layer."""
    return sum(
        layer.keys.nbytes + layer.values.nbytes
        for layer in cache.layers
        if getattr(layer, "keys", None) is not None and layer.keys.numel()
    )


def answer(model, tokenizer, sample, budget: int | None, max_new_tokens: int = 8) -> dict:
    """``model.generate`` over the sample's prompt, chunked prefill of 512 tokens, with the
    model's own cache (``budget=None``) or BMRTCache(budget)."""
    import torch
    from transformers import DynamicCache

    from bmrt_kv import BMRTCache, BMRTConfig
    from bmrt_kv.hooks import cache_keyword

    ids = tokenizer(sample.context + sample.question, return_tensors="pt").input_ids
    keyword = cache_keyword(model)
    start = time.perf_counter()
    with torch.inference_mode():
        if budget is None:
            cache = DynamicCache(config=model.config)
            out = _generate(model, ids, keyword, cache, max_new_tokens)
            peak = None
        else:
            with BMRTCache(model, BMRTConfig(budget=budget)) as cache:
                out = _generate(model, ids, keyword, cache, max_new_tokens)
                peak = cache.peak_kv_bytes()
                limits = cache.token_limits
    text = tokenizer.decode(out[0, ids.shape[-1] :], skip_special_tokens=True).strip()
    result = {
        "tokens": ids.shape[-1],
        "output": text,
        "correct": sample.correct(text),
        "kv_bytes": kv_held(cache),
        "peak_kv_bytes": peak,
        "seconds": time.perf_counter() - start,
    }
    if budget is not None:
        result["token_limits"] = sorted(set(limits))
    return result


def _generate(model, ids, keyword, cache, max_new_tokens):
    return model.generate(
        ids,
        prefill_chunk_size=PREFILL_CHUNK,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        **{keyword: cache},
    )


def accuracy(args) -> None:
    import random

    import torch
    from evaluation import passkey_sample

    torch.set_num_threads(args.threads)
    model, tokenizer = load_hybrid(args.window, args.pattern, args.source)
    load = [os.getloadavg()[0]]
    rng = random.Random(args.seed)
    keys = [rng.randint(10000, 99999) for _ in range(args.keys)]
    rows = []
    methods = [None, *args.budgets]
    for depth in args.depths:
        for key in keys:
            sample = passkey_sample(tokenizer, args.tokens, key=key, depth=depth)
            for budget in methods:
                r = answer(model, tokenizer, sample, budget)
                load.append(os.getloadavg()[0])
                rows.append(
                    [
                        r["tokens"],
                        depth,
                        key,
                        "own cache" if budget is None else "BMRTCache",
                        "-" if budget is None else budget,
                        "yes" if r["correct"] else "no",
                        r["output"][:24],
                        round(r["kv_bytes"] / 2**20, 1),
                        "-" if r["peak_kv_bytes"] is None else round(r["peak_kv_bytes"] / 2**20, 1),
                    ]
                )
                print(rows[-1], f"{r['seconds']:.0f} s", flush=True)
                _write_accuracy(args, rows, load)


def _summary(rows) -> list[dict]:
    """The issue's target: the key found wherever the model's own cache finds it."""
    own = {(r[1], r[2]): r[5] == "yes" for r in rows if r[3] == "own cache"}
    out = []
    for budget in sorted({r[4] for r in rows if r[3] == "BMRTCache"}):
        mine = {(r[1], r[2]): r[5] == "yes" for r in rows if r[4] == budget}
        both = [k for k in mine if k in own]
        missed = [k for k in both if own[k] and not mine[k]]
        out.append(
            {
                "target": f"B={budget}: the pass key found wherever the model's own cache finds it",
                "measured": f"own cache {sum(own[k] for k in both)}/{len(both)}, BMRTCache "
                f"{sum(mine[k] for k in both)}/{len(both)}"
                + (f"; missed where the own cache found it: {missed}" if missed else ""),
                "met": not missed,
            }
        )
    return out


def _write_accuracy(args, rows, load) -> None:
    from common import write_result

    write_result(
        args.name,
        f"Pass key on a hybrid SmolLM2 (window {args.window}, layers {args.pattern} "
        f"repeated), ~{args.tokens} tokens: the model's own cache vs BMRTCache",
        [
            "tokens",
            "depth",
            "key",
            "cache",
            "B",
            "found",
            "answer",
            "KV MiB held (end)",
            "peak KV MiB",
        ],
        rows,
        _summary(rows),
        command="hatch run bmrt-kv:python packages/bmrt-kv/benchmarks/hybrid.py "
        + " ".join(args.argv),
        notes="Model: SmolLM2-135M-Instruct's weights (membound_testing's float copy) in a "
        f"Qwen2Config with the same sizes, rope and tied embeddings, sliding_window "
        f"{args.window}, layer_types {args.pattern!r} (S sliding, F full) repeated over the "
        "30 layers, q/k/v biases zero (benchmarks/hybrid.py: hybrid_dir). Each "
        "prompt: benchmarks/evaluation.py's passkey_sample (filler, the key line at the depth, 'What "
        "is the pass key? The pass key is'), model.generate greedy, 8 new tokens, "
        f"prefill_chunk_size {PREFILL_CHUNK}; own cache DynamicCache(config=model.config) "
        "(full layers keep every token, sliding layers their window); BMRTCache(model, "
        "BMRTConfig(budget=B)) with the defaults (keydiff, agnostic; sliding layers keep the "
        "model's window, full layers B). Found: the first number of the answer is the key. "
        "KV MiB held: every layer's keys and values at the end of generation; peak: "
        "BMRTCache.peak_kv_bytes() (each layer at its largest, during a block). Torch "
        f"{args.threads} threads; 1-minute load average {min(load):.1f} to {max(load):.1f} "
        "during the run (2 cores, shared).",
    )


# ---- the minimum hard limit -------------------------------------------------------------


def child(args) -> None:
    """Answer the key at ``--depth`` with one method; prints the answer on the last line."""
    import torch
    from evaluation import passkey_sample

    torch.set_num_threads(args.threads)
    model, tokenizer = load_hybrid(args.window, args.pattern)
    sample = passkey_sample(tokenizer, args.tokens, key=MIN_LIMIT_KEY, depth=args.depth)
    budget = None if args.child == "own" else int(args.child)
    r = answer(model, tokenizer, sample, budget)
    print(f"kv_bytes={r['kv_bytes']} peak_kv_bytes={r['peak_kv_bytes']}", flush=True)
    print(r["output"], flush=True)


def bmrt_python() -> str:
    """The bmrt-kv environment's interpreter (transformers 5.24, as the accuracy part)."""
    found = subprocess.run(
        ["hatch", "env", "find", "bmrt-kv"], capture_output=True, text=True, check=True
    )
    python = Path(found.stdout.strip()) / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no bmrt-kv environment at {python}")
    return str(python)


def min_limits(args) -> None:
    from common import write_result

    from membound_testing.budget.profiles import MiB
    from membound_testing.budget.runner import bisect_min_limit, run_limited

    python = bmrt_python()
    load = [os.getloadavg()[0]]
    rows, raw = [], []
    for method in args.methods:
        command = [python, __file__, "--child", method, "--tokens", str(args.tokens)]
        command += ["--window", str(args.window), "--pattern", args.pattern]
        command += ["--threads", str(args.threads), "--depth", str(args.depth)]
        start = time.perf_counter()
        first = run_limited(command, 4096 * MiB)
        load.append(os.getloadavg()[0])
        if not first.completed or str(MIN_LIMIT_KEY) not in first.stdout:
            entry = {
                "method": method,
                "unlimited": first.status,
                "output": first.stdout[-200:],
                "stderr": first.stderr[-400:],
            }
        else:
            timeout = max(90.0, 4 * first.wall_s)
            kv = first.stdout.strip().splitlines()[-2]

            def passes(
                limit: int, command=command, timeout=timeout, method=method
            ) -> tuple[bool, str]:
                result = run_limited(command, limit, timeout=timeout)
                load.append(os.getloadavg()[0])
                if not result.completed:
                    ok, status = False, result.status
                else:
                    ok = str(MIN_LIMIT_KEY) in result.stdout.strip().splitlines()[-1]
                    status = "ok" if ok else "wrong answer"
                print(f"  {method} at {limit // MiB} MiB: {status}", flush=True)
                return ok, status

            hi = (first.peak_usage // MiB + 32) * MiB
            found = bisect_min_limit(passes, args.lo * MiB, hi, args.resolution * MiB)
            entry = {
                "method": method,
                "min_limit_mib": None if found.min_bytes is None else found.min_bytes // MiB,
                "peak_anon_mib": round(first.peak_anon / MiB, 1),
                "peak_usage_mib": round(first.peak_usage / MiB, 1),
                "wall_s": round(first.wall_s, 1),
                "kv": kv,
                "output": first.stdout.strip().splitlines()[-1][:40],
                "tries": [[limit // MiB, ok, status] for limit, ok, status in found.tries],
            }
        raw.append(entry)
        print(json.dumps(entry), f"{time.perf_counter() - start:.0f} s", flush=True)
        rows.append(
            [
                args.tokens,
                "own cache" if method == "own" else "BMRTCache",
                "-" if method == "own" else method,
                entry.get("min_limit_mib", f"not run: unlimited run {entry.get('unlimited')}"),
                entry.get("peak_anon_mib", "-"),
                entry.get("peak_usage_mib", "-"),
                entry.get("kv", "-"),
                entry.get("output", ""),
            ]
        )
        write_result(
            args.name,
            f"Minimum hard memory limit, hybrid SmolLM2 (window {args.window}, layers "
            f"{args.pattern} repeated), {args.tokens}-token pass key at depth {args.depth}",
            [
                "tokens",
                "cache",
                "B",
                "min limit MiB",
                "peak anon MiB (no limit)",
                "peak usage MiB (no limit)",
                "KV bytes (end; BMRTCache peak)",
                "answer",
            ],
            rows,
            [],
            command=f"MEMBOUND_CACHE={os.environ.get('MEMBOUND_CACHE', '~/.cache/membound')} "
            "hatch run python packages/bmrt-kv/benchmarks/hybrid.py " + " ".join(args.argv),
            notes="The model as in hybrid.py's accuracy run (SmolLM2's weights in a hybrid "
            "Qwen2 config). Each method in a fresh process per try (the bmrt-kv "
            "environment's interpreter), in its own cgroup (hard limit, swap off, page cache "
            f"dropped first); bisected at {args.resolution} MiB resolution between {args.lo} MiB "
            "(taken to fail untried) and "
            "the run's own peak without a limit (+32 MiB); a try passes when it answers the "
            "right key within max(90 s, 4x the unlimited run's wall time). Both caches via "
            f"model.generate, prefill_chunk_size {PREFILL_CHUNK}. Torch {args.threads} "
            "threads. Every try: "
            + json.dumps([{e["method"]: e.get("tries")} for e in raw])
            + f". 1-minute load average {min(load):.1f} to {max(load):.1f} during the run "
            "(2 cores, shared).",
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--window", type=int, default=512, help="sliding window, tokens")
    parser.add_argument(
        "--pattern",
        default="S" * 6 + "F" * 24,
        help="layer kinds, S sliding / F full, repeated over the 30 layers",
    )
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--keys", type=int, default=1, help="keys per depth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--source",
        type=Path,
        default=None,
        help="SmolLM2's float copy to build the hybrid from (default: "
        "membound_testing.models.smollm2_float_dir())",
    )
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--min-limits", action="store_true")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["own", "512", "1024"],
        help="--min-limits: 'own' or a budget B",
    )
    parser.add_argument("--resolution", type=int, default=16, help="MiB")
    parser.add_argument("--depth", type=float, default=0.1, help="--min-limits: the key's depth")
    parser.add_argument(
        "--lo", type=int, default=64, help="--min-limits: MiB taken to fail without a try"
    )
    parser.add_argument("--name", default=None, help="results/<name>.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.child:
        child(args)
    elif args.build_only:
        print(hybrid_dir(args.window, args.pattern, args.source))
    elif args.min_limits:
        args.name = args.name or f"hybrid_min_limits_{args.tokens}"
        min_limits(args)
    else:
        args.name = args.name or f"hybrid_passkey_{args.tokens}"
        accuracy(args)


if __name__ == "__main__":
    main()
