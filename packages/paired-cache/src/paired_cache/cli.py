"""``paired-cache`` command line: ``convert`` writes a model's neuron pools to a pool file;
``fit-predictor`` fits the trained predictors (one file for every fraction); ``ask`` answers a prompt with the model
loaded by ``load_sparse``. (The update microbenchmark is ``benchmarks/microbench.py``,
outside the installed package.)

Expected failures (a bad argument, a missing or unreadable file) print
``paired-cache: error: <message>`` and exit with status 2, as argparse does for bad
options; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paired_cache.errors import PairedCacheError
from paired_cache.registry import MASK_SOURCES
from paired_cache.sparse_base import PREFILL_MODES
from paired_cache.sparse_mlp import ROW_MODES
from paired_cache.trained_predictor import KINDS

PROG = "paired-cache"


def cmd_convert(args: argparse.Namespace) -> int:
    from paired_cache.model_io import convert

    layers = convert(
        args.source,
        args.out,
        gate=not (args.no_gate or args.compress or args.grid),
        progress=not args.quiet,
        compress="grid" if args.grid else args.compress,
        compress_level=args.compress_level,
    )
    total = sum(layer.nbytes for layer in layers)
    print(f"{args.out}: {len(layers)} MLP pools, {total / 2**20:.1f} MiB")
    return 0


def _load_dense(model: str):
    """A float32 model and its tokenizer from a HF directory or a .gguf file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model)
    if not path.exists():
        raise PairedCacheError(f"{path} does not exist")
    where = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = str(path.parent) if where else str(path)
    if not where and not (path / "config.json").is_file():
        raise PairedCacheError(f"{path}: expected a model directory (config.json) or a .gguf file")
    dense = AutoModelForCausalLM.from_pretrained(root, dtype="float32", **where).eval()
    return dense, AutoTokenizer.from_pretrained(root, **where)


def cmd_fit_predictor(args: argparse.Namespace) -> int:
    from paired_cache.model_io import _Progress
    from paired_cache.trained_predictor import (
        PARTS,
        TrainConfig,
        fit_predictors,
        save_predictors,
    )

    config = TrainConfig(rank=getattr(args, "rank", None), kind=args.kind)
    text = Path(args.text).read_text(encoding="utf-8")
    model, tokenizer = _load_dense(args.model)
    ids = tokenizer(text, return_tensors="pt").input_ids
    layers = model.config.num_hidden_layers
    progress = None if args.quiet else _Progress(layers)
    predictors = fit_predictors(model, ids, config, progress=progress)
    save_predictors(args.out, predictors)
    rank = next(iter(predictors.values()))[PARTS[args.kind][0]].shape[1]
    print(
        f"{args.out}: {len(predictors)} {args.kind} predictors, rank {rank}, {ids.shape[1]} tokens"
    )
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from paired_cache.model_io import load_sparse

    options = {} if args.predictor is None else {"predictor": args.predictor}
    if args.source == "trained" and args.predictor is None:
        raise PairedCacheError("--source trained needs --predictor FILE (from fit-predictor)")
    model = load_sparse(
        args.model_dir,
        args.pool,
        args.source,
        args.fraction,
        window=args.window,
        rows=args.rows,
        prefill=args.prefill,
        keep_cached=args.keep_cached,
        **options,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": args.prompt}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    else:
        text = args.prompt
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tokenizer.decode(out[0, ids.shape[-1] :], skip_special_tokens=True))
    return 0


def _keep_cached(text: str) -> int | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"'auto', 'none' or a byte count >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser(
        "convert", help="write every MLP's neuron pool to a pool file", formatter_class=fmt
    )
    conv.add_argument("source", help="a HF model directory, a .safetensors file or a .gguf file")
    conv.add_argument("out", help="the pool file to write (replaced atomically)")
    conv.add_argument(
        "--no-gate",
        action="store_true",
        help="rows of up | down_T only, a third smaller: for load_sparse with a source that "
        "computes act(gate x) from gate_proj in the safetensors (cats, the gated predictor)",
    )
    conv.add_argument(
        "--compress",
        action="store_true",
        help="a compressed pool: no gate, one zstd frame per row of up | down_T, read in "
        "place by load_sparse (cats, the gated predictor)",
    )
    conv.add_argument(
        "--grid",
        action="store_true",
        help="a grid pool: no gate, each row as the Q4_1 / Q8_0 codes its float32 weights "
        "were dequantized from (a GGUF's float copy), decoded bit for bit; refused for "
        "weights not exactly on such a grid",
    )
    conv.add_argument(
        "--compress-level", type=int, default=19, help="the zstd level of --compress, 1 to 22"
    )
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)

    fit = sub.add_parser(
        "fit-predictor",
        help="fit the trained predictor of every MLP from a calibration text (any fraction)",
        formatter_class=fmt,
    )
    fit.add_argument("model", help="a HF model directory (config.json, *.safetensors) or .gguf")
    fit.add_argument("text", help="a UTF-8 calibration text file")
    fit.add_argument("out", help="the .safetensors file to write, beside the pool file")
    fit.add_argument(
        "--kind",
        choices=KINDS,
        default="gated",
        help="gated: the gate computed exactly, up x predicted at low rank (holds quality); "
        "linear: x -> rank -> N logits, no gate (Deja Vu)",
    )
    fit.add_argument(
        "--rank",
        type=int,
        default=argparse.SUPPRESS,  # not "(default: None)": the default depends on --kind
        help="predictor rank (default: gated 64, linear 128)",
    )
    fit.add_argument("--quiet", action="store_true", help="no progress bar")
    fit.set_defaults(func=cmd_fit_predictor)

    ask = sub.add_parser(
        "ask",
        help="answer a prompt with load_sparse: MLPs from the pool file, the rest mapped",
        formatter_class=fmt,
    )
    ask.add_argument("model_dir", help="the HF model directory the pool file was converted from")
    ask.add_argument("pool", help="the pool file (paired-cache convert)")
    ask.add_argument("prompt", help="the question (framed by the chat template if there is one)")
    ask.add_argument("--source", choices=sorted(MASK_SOURCES), default="cats", help="mask source")
    ask.add_argument("--fraction", type=float, default=0.5, help="share of active rows")
    ask.add_argument("--window", type=int, default=1, help="tokens whose rows stay resident")
    ask.add_argument(
        "--rows",
        choices=ROW_MODES,
        default=None,
        help="in_place: multiplied where they lie in the mapped pool (window 1); copy: the "
        "active rows cached and updated (any window). Default: in_place with --window 1, "
        "copy otherwise",
    )
    ask.add_argument(
        "--prefill",
        choices=PREFILL_MODES,
        default="dense",
        help="the prompt over every row at once (dense) or token by token with its masks (sparse)",
    )
    ask.add_argument(
        "--keep-cached",
        type=_keep_cached,
        default="auto",
        help="bytes of what each token reads in full kept in the page cache between tokens, "
        "the rest paged out after use: 'auto' (from the memory cgroup's limit; nothing "
        "paged out without one), 'none' (the kernel decides) or a byte count",
    )
    ask.add_argument("--predictor", help="the predictor file of --source trained")
    ask.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate")
    ask.set_defaults(func=cmd_ask)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (PairedCacheError, ValueError, OSError) as exc:
        # UnicodeDecodeError is a ValueError: a calibration text that is not UTF-8.
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
