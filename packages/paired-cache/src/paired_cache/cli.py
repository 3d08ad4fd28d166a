"""``paired-cache`` command line: ``convert`` writes a model's neuron pools to a pool file;
``fit-predictor`` trains the Deja Vu predictors. (The update microbenchmark is
``benchmarks/microbench.py``, outside the installed package.)"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
        text = Path(args.text).read_text(encoding="utf-8")
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="float32").eval()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
        ids = tokenizer(text, return_tensors="pt").input_ids
        layers = model.config.num_hidden_layers
        progress = None if args.quiet else _Progress(layers)
        predictors = fit_predictors(model, ids, args.fraction, config, progress=progress)
        save_predictors(args.out, predictors, args.fraction)
    except (PairedCacheError, OSError, UnicodeDecodeError) as exc:
        print(f"paired-cache fit-predictor: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(predictors)} predictors, rank {args.rank}, {ids.shape[1]} tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paired-cache")
    sub = parser.add_subparsers(dest="command", required=True)
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
    commands = {"convert": _convert, "fit-predictor": _fit_predictor}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
