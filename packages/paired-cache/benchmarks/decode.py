"""Decode speed of SmolLM2-135M from storage: SparseMLP over the mapped pool file against the
plain model mmap'd by transformers, side by side (A B A B ...), and where a sparse token's
time goes (mask, update, gathered matmuls, the rest).

    hatch run paired-cache:python packages/paired-cache/benchmarks/decode.py [--quick]
        [--predictor PATH] [--rounds R] [--tokens T] [--breakdown-only]

Timed: run it on a quiet machine. --breakdown-only skips the A/B rounds and only reports
the proportions of a sparse token (wrapping the SparseMLP's parts with perf_counter).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import NOISE, write_result
from texts import DOCS_TOKENS, HELD_OUT, docs_ids

from paired_cache.model_io import convert, load_sparse
from paired_cache.trained_predictor import fit_predictors, save_predictors

FRACTION = 0.5


def decode(model, prompt: torch.Tensor, tokens: int, on_prefilled=None) -> float:
    """Seconds per generated token after the prompt: greedy, one token at a time;
    on_prefilled() runs between the prompt and the timed tokens."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = model(prompt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        if on_prefilled is not None:
            on_prefilled()
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / tokens


def breakdown(model, prompt: torch.Tensor, tokens: int) -> dict[str, float]:
    """Microseconds per token spent in each SparseMLP part, summed over layers, and the
    whole token: wraps source.select_with_gate, cache.update and _active_forward of every
    MLP."""
    totals = {"mask": 0.0, "update": 0.0, "matmul": 0.0}
    mlps = [layer.mlp for layer in model.model.layers]

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            result = fn(*args, **kwargs)
            totals[key] += time.perf_counter() - t
            return result

        return wrapper

    for m in mlps:
        # What SparseMLP calls per token: the mask, and the gate when the source computed it.
        m.source.select_with_gate = timed(m.source.select_with_gate, "mask")
        m.cache.update = timed(m.cache.update, "update")
        m._active_forward = timed(m._active_forward, "matmul")

    def reset():
        for key in totals:
            totals[key] = 0.0

    decode(model, prompt, 2)  # warm
    per_token = decode(model, prompt, tokens, on_prefilled=reset)
    out = {k: v / tokens * 1e6 for k, v in totals.items()}
    out["token"] = per_token * 1e6
    out["rest"] = out["token"] - out["mask"] - out["update"] - out["matmul"]
    out["layers"] = len(mlps)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--predictor", default=None, help="a fit-predictor file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--breakdown-only", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens = 1, 3

    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from membound_testing import smollm2_float_dir

    torch.set_num_threads(1)
    model_dir = smollm2_float_dir()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    prompt = tokenizer(HELD_OUT, return_tensors="pt").input_ids[:, :24]
    with tempfile.TemporaryDirectory() as tmp:
        pool = Path(tmp) / "smollm2.pcpool"
        convert(model_dir, pool, progress=False)
        dense = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="float32").eval()
        predictor = args.predictor
        if predictor is None:
            calibration = docs_ids(tokenizer, 1024 if args.quick else DOCS_TOKENS)
            predictor = Path(tmp) / "predictor.safetensors"
            save_predictors(predictor, fit_predictors(dense, calibration))
        variants = {
            "dense (transformers, mmap'd safetensors)": lambda: dense,
            "cats 50%": lambda: load_sparse(
                model_dir, pool, "cats", FRACTION, rows="copy", prefill="sparse"
            ),
            "cats 50%, window 4": lambda: load_sparse(
                model_dir, pool, "cats", FRACTION, window=4, prefill="sparse"
            ),
            "trained 50%": lambda: load_sparse(
                model_dir,
                pool,
                "trained",
                FRACTION,
                predictor=predictor,
                rows="copy",
                prefill="sparse",
            ),
            # No active rows: the C kernel multiplies each token's rows in the mapped pool.
            "trained 50%, rows in place": lambda: load_sparse(
                model_dir,
                pool,
                "trained",
                FRACTION,
                predictor=predictor,
                rows="in_place",
                prefill="sparse",
            ),
        }
        models = {name: build() for name, build in variants.items()}
        parts = {
            name: breakdown(m, prompt, args.tokens)
            for name, m in models.items()
            if name.startswith(("cats 50%", "trained"))
            and "window" not in name
            and "in place" not in name  # no cache update to time apart
        }
        for name, b in parts.items():
            share = {k: round(b[k] / b["token"], 2) for k in ("mask", "update", "matmul", "rest")}
            print(f"{name}: {b['token']:.0f} us/token, shares {share}", file=sys.stderr)
        if args.breakdown_only:
            return
        # Rebuild: the breakdown wrapped the sparse models' methods.
        models.update({n: variants[n]() for n in parts})
        times: dict[str, list[float]] = {name: [] for name in models}
        for m in models.values():
            decode(m, prompt, 2)  # warm: page in what the token reads
        for _ in range(args.rounds):
            for name, m in models.items():  # interleaved: A B C D A B C D ...
                times[name].append(decode(m, prompt, args.tokens))
    dense_s = statistics.median(times[next(iter(times))])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        b = parts.get(name)
        per_layer = [
            round(b[k] / b["layers"], 1) if b else "" for k in ("mask", "update", "matmul")
        ]
        rest = round(b["rest"] / b["token"], 2) if b else ""
        rows.append([name, round(1 / med, 2), round(dense_s / med, 2), *per_layer, rest])
    sparse_50 = next(r for r in rows if r[0] == "trained 50%")
    in_place = next(r for r in rows if r[0] == "trained 50%, rows in place")
    write_result(
        "decode",
        f"Decode speed, SmolLM2-135M float32 from storage, 1 thread, {args.tokens} tokens "
        f"after a {prompt.shape[1]}-token prompt, {args.rounds} interleaved rounds",
        [
            "model",
            "tokens/s (median)",
            "x dense",
            "mask us/layer",
            "update us/layer",
            "matmul us/layer",
            "rest share of a token",
        ],
        rows,
        [
            {
                "target": "SparseMLP at 50% (trained) >= 1.0x dense tokens/s (ample memory)",
                "measured": f"{sparse_50[2]}x",
                "met": sparse_50[2] >= 1.0,
            },
            {
                "target": "SparseMLP at 50% (trained, rows in place) >= 1.0x dense tokens/s "
                "(ample memory)",
                "measured": f"{in_place[2]}x",
                "met": in_place[2] >= 1.0,
            },
        ],
        NOISE + " Dense is the plain model as transformers loads it (safetensors mmap'd); "
        "the sparse models are load_sparse over the pool file (mapped read-only), the "
        "other weights mapped from the same safetensors. The per-layer columns come from a "
        "separate pass that wraps each SparseMLP's mask source, cache update and matmuls "
        "with perf_counter (its overhead lands in those columns); rest: attention, "
        "lm_head, norms and per-token Python, as a share of that pass's token.",
        save=not args.quick,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
