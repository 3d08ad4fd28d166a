"""``paired-cache`` command line: ``convert`` writes a model's neuron pools to a pool file;
``fit-predictor`` trains the Deja Vu predictors; ``bench`` runs the update microbenchmark."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

from paired_cache.config import CacheConfig
from paired_cache.microbench import BenchConfig, markdown, run


def _bench(args: argparse.Namespace) -> int:
    cfg = BenchConfig(steps=args.steps or (20 if args.quick else 200))
    if args.quick:
        cfg = BenchConfig(
            n_rows=2048, hidden=256, cols=256, m=256, ks=(16, 64, 256), steps=cfg.steps
        )
    threads = CacheConfig().num_threads if args.threads is None else args.threads
    result = run(cfg, threads, progress=lambda s: print(s, file=sys.stderr))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(markdown(result["columns"], result["rows"]))
    if args.json:
        payload = {k: result[k] for k in ("columns", "rows")}
        directory = os.path.dirname(os.path.abspath(args.json))
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, args.json)  # never a half-written file
    return 0


def _convert(args: argparse.Namespace) -> int:
    from paired_cache.errors import PairedCacheError
    from paired_cache.model_io import convert

    try:
        layers = convert(args.source, args.out, progress=not args.quiet)
    except PairedCacheError as exc:
        print(f"paired-cache convert: {exc}", file=sys.stderr)
        return 2
    total = sum(layer.nbytes for layer in layers)
    print(f"{args.out}: {len(layers)} MLP pools, {total / 2**20:.1f} MiB")
    return 0


def _fit_predictor(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from paired_cache.errors import PairedCacheError
    from paired_cache.model_io import _Progress
    from paired_cache.trained_predictor import TrainConfig, fit_predictors, save_predictors

    try:
        config = TrainConfig(rank=args.rank, steps=args.steps)
        text = open(args.text, encoding="utf-8").read()  # noqa: SIM115 - read once, closed by gc
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="float32").eval()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
        ids = tokenizer(text, return_tensors="pt").input_ids
        layers = model.config.num_hidden_layers
        progress = None if args.quiet else _Progress(layers)
        predictors = fit_predictors(model, ids, args.fraction, config, progress=progress)
        save_predictors(args.out, predictors, args.fraction)
    except (PairedCacheError, OSError) as exc:
        print(f"paired-cache fit-predictor: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(predictors)} predictors, rank {args.rank}, {ids.shape[1]} tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paired-cache")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time cache updates against rebuild baselines")
    bench.add_argument("--quick", action="store_true", help="small sizes, few steps")
    bench.add_argument("--steps", type=int, default=None, help="updates per cell (default 200)")
    bench.add_argument(
        "--threads", type=int, default=None, help="copy threads and torch threads (default: cores)"
    )
    bench.add_argument("--json", default=None, help="also write the table as JSON here")
    conv = sub.add_parser("convert", help="write every MLP's neuron pool to a pool file")
    conv.add_argument("source", help="a HF model directory, a .safetensors file or a .gguf file")
    conv.add_argument("out", help="the pool file to write (replaced atomically)")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    fit = sub.add_parser(
        "fit-predictor", help="train the Deja Vu predictor of every MLP from a calibration text"
    )
    fit.add_argument("model_dir", help="a HF model directory (config.json, *.safetensors)")
    fit.add_argument("text", help="a UTF-8 calibration text file")
    fit.add_argument("out", help="the .safetensors file to write, beside the pool file")
    fit.add_argument("--fraction", type=float, default=0.5, help="active rows (default 0.5)")
    fit.add_argument("--rank", type=int, default=128, help="predictor rank (default 128)")
    fit.add_argument("--steps", type=int, default=300, help="AdamW steps per layer")
    fit.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    commands = {"convert": _convert, "fit-predictor": _fit_predictor, "bench": _bench}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
