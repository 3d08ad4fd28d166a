"""``diffulex-edge export | generate``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diffulex_edge.checkpoint import load_checkpoint
from diffulex_edge.config import tiny_config
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.export import EXPORT_VARIANTS, QUANTIZATIONS
from diffulex_edge.generate import GenerationConfig
from diffulex_edge.remasking import REMASKING
from diffulex_edge.sampling import SamplingConfig

__all__ = ["build_parser", "main"]

# Defaults by model kind: SDAR decodes blocks of 4; an autoregressive model (no mask token)
# decodes one token per forward and prefills its prompt in chunks.
DIFFUSION_DEFAULTS = {"block_size": 4, "max_seq": 64, "prefill_size": None}
AUTOREGRESSIVE_DEFAULTS = {"block_size": 1, "max_seq": 256, "prefill_size": 32}


TINY_NOTE = (
    "diffulex-edge: note: --tiny is a seeded random model (untrained weights): its tokens "
    "are noise, for checking the pipeline, not for reading"
)
# The toy sorting model left the wheel in 0.10.0 (#56); a repository checkout has it.
SORT8_CHECKOUT = "packages/diffulex-edge/benchmarks/checkpoints/sort8"
NO_SOURCE = (
    "no model given: pass MODEL_DIR (or --checkpoint), --gguf or --tiny (generate also "
    "--pte); the toy sorting model that was the default is no longer installed: from a "
    f"repository checkout it is {SORT8_CHECKOUT}"
)
BENCH_MOVED = (
    "the bench command left the package in 0.10.0 with the toy sorting model it runs: from "
    "a repository checkout run python packages/diffulex-edge/benchmarks/sort_bench.py "
    "[--prompts N --threads N --remasking R]"
)
# Without a tokenizer, --prompt is digits in the toy sorting model's vocabulary
# (benchmarks/sort_task.py): ids 0-9 are the digits, 10 ends the prompt.
_DIGITS, _SEP = 10, 10
_DIGIT_NAMES = {10: "|", 11: "<eos>", 12: "<mask>"}


def _tiny_model():
    """``--tiny``: ``tiny_config()`` with seeded random weights, norm gains perturbed too
    (the tests' tiny model, ``benchmarks/random_sdar.random_model(tiny_config(), seed=0)``)."""
    import torch

    from diffulex_edge.model import SDARModel

    gen = torch.Generator().manual_seed(0)
    model = SDARModel(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(gain + 0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _model(args):
    if args.tiny:
        print(TINY_NOTE, file=sys.stderr)
        return _tiny_model()
    if args.gguf:
        from diffulex_edge.hf_import import load_gguf

        return load_gguf(args.gguf)
    if args.model_dir is None and args.checkpoint is None:
        raise DiffulexEdgeError(NO_SOURCE)
    return load_checkpoint(args.model_dir or args.checkpoint)


def _encode_digits(text: str) -> list[int]:
    if not text or not text.isdigit():
        raise ValueError(
            f"prompt must be a non-empty string of digits, got {text!r} (without a tokenizer "
            "--prompt is digits; pass --tokenizer or --prompt-ids)"
        )
    return [int(c) for c in text] + [_SEP]


def _decode_digits(ids: list[int]) -> str:
    return "".join(str(i) if i < _DIGITS else _DIGIT_NAMES.get(i, f"<{i}>") for i in ids)


def _add_source(p, with_pte: bool) -> None:
    p.add_argument(
        "model_dir",
        nargs="?",
        help="Hugging Face-layout directory (config.json + safetensors): SDAR or a family "
        "of the README's supported models except Phi-3 (fused tensors) (default: none; "
        "one source is needed)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", help="the same as MODEL_DIR")
    group.add_argument("--gguf", help="a GGUF file (dequantised by transformers; the hf extra)")
    group.add_argument(
        "--tiny", action="store_true", help="a seeded random tiny config (untrained: noise)"
    )
    if with_pte:
        group.add_argument("--pte", help="an exported diffulex-edge .pte")
    p.epilog = (
        "One source is needed. The toy sorting model is in a repository checkout: "
        f"{SORT8_CHECKOUT}."
    )


def _tokenizer(args):
    """The Hugging Face tokenizer of --tokenizer (a directory or a GGUF file), else of
    MODEL_DIR or --gguf when they have one."""
    source = args.tokenizer
    if source is None:
        model_dir = args.model_dir or args.checkpoint
        if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
            source = model_dir
        elif args.gguf is not None:
            source = args.gguf
    if source is None:
        return None
    source = Path(source)
    is_gguf = source.suffix == ".gguf"
    if is_gguf and not source.is_file():
        raise FileNotFoundError(f"--tokenizer {source}: no such GGUF file")
    if not is_gguf and not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"--tokenizer {source} is neither a directory with a tokenizer.json nor a .gguf file"
        )
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError as err:
        raise ValueError(
            "a text tokenizer needs transformers: pip install 'diffulex-edge[hf]'"
        ) from err
    if is_gguf:
        return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    return PreTrainedTokenizerFast.from_pretrained(str(source))


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",")]
        except ValueError as err:
            msg = f"--prompt-ids must be comma-separated ints, got {args.prompt_ids!r}"
            raise ValueError(msg) from err
    if tokenizer is None:
        return _encode_digits(args.prompt)
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens: add none (some tokenizers add a BOS).
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def _calibration(args):
    """The token ids --quantize calibrates on (None: random ids, said on stderr); checked
    before the model is loaded."""
    if args.quantize is None:
        if args.calibration is not None:
            raise ValueError("--calibration is for --quantize")
        return None
    from diffulex_edge.calibration import calibration_ids

    text = None
    if args.calibration is not None:
        path = Path(args.calibration)
        if not path.is_file():
            raise FileNotFoundError(f"--calibration {path}: no such file")
        text = path.read_text(encoding="utf-8")
    tokenizer = _tokenizer(args)
    if tokenizer is None:
        if text is not None:
            raise ValueError("--calibration needs a tokenizer: pass --tokenizer")
        print(
            "no tokenizer: --quantize calibrates on random token ids (pass --tokenizer for text)",
            file=sys.stderr,
        )
        return None
    return calibration_ids(tokenizer, text)


def cmd_export(args) -> None:
    from diffulex_edge.export import export_pte

    if (args.no_grid or args.grid is not None) and args.quantize is None:
        raise ValueError("--no-grid and --grid are for --quantize")
    if args.no_grid and args.grid is not None:
        raise ValueError("--no-grid and --grid exclude each other")
    grid = {}
    if args.no_grid:
        grid = {"grid": False}
    elif args.grid is not None:
        names = tuple(name.strip() for name in args.grid.split(",") if name.strip())
        grid = {"grid": True if names == ("all",) else names}
    calibration = _calibration(args)
    model = _model(args)
    defaults = AUTOREGRESSIVE_DEFAULTS if model.config.mask_token_id is None else DIFFUSION_DEFAULTS
    block_size = defaults["block_size"] if args.block_size is None else args.block_size
    max_seq = defaults["max_seq"] if args.max_seq is None else args.max_seq
    prefill = defaults["prefill_size"] if args.prefill_size is None else args.prefill_size or None
    if args.prefill_size is None and (args.variant == "cache_io" or block_size != 1):
        prefill = None  # the default only; an explicit --prefill-size is refused by export_pte
    result = export_pte(
        model,
        args.output,
        max_seq,
        block_size,
        args.variant,
        args.quantize,
        prefill,
        progress=True,
        calibration=calibration,
        **grid,
    )
    print(
        f"wrote {result.path} ({result.pte_bytes / 2**20:.2f} MiB, {result.variant}, "
        f"block size {block_size}, prefill chunk {prefill}, "
        f"static KV {result.layout.nbytes} bytes = {result.layout.shape})"
    )


def cmd_generate(args) -> None:
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        remasking=args.remasking,
        threshold=args.threshold,
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed),
    )
    tokenizer = _tokenizer(args)
    prompt = _prompt_ids(args, tokenizer)
    if args.pte:
        from diffulex_edge.runtime import PteEngine

        engine = PteEngine(args.pte, allow_unverified=args.allow_unverified)
        result = engine.generate(prompt, config)
        c_eos = engine.eos_token_id
    else:
        from diffulex_edge.backends import EagerDynamic
        from diffulex_edge.generate import check_token_ids, generate, generate_autoregressive

        model = _model(args)
        c = model.config
        c_eos = c.eos_token_id
        check_token_ids(prompt, c.vocab_size)
        if c.mask_token_id is None:
            backend = EagerDynamic(model, 1)
            result = generate_autoregressive(backend, prompt, config, c.eos_token_id)
        else:
            backend = EagerDynamic(model, args.block_size)
            result = generate(backend, prompt, config, c.mask_token_id, c.eos_token_id)
    if not result.tokens:
        eos = "" if c_eos is None else f" (token {c_eos})"
        print(
            f"diffulex-edge: note: no tokens generated: the model's first token was its "
            f"end-of-sequence token{eos}. Check that the prompt has the form the model was "
            "trained on (the toy sorting model: 8 digits, then the separator 10, e.g. "
            "--prompt-ids 3,1,4,1,5,9,2,6,10 or --prompt 31415926)",
            file=sys.stderr,
        )
    if args.prompt is None:
        print(result.tokens)
    elif tokenizer is not None:
        print(tokenizer.decode(result.tokens, skip_special_tokens=True))
    else:
        print(_decode_digits(result.tokens))
    print(
        f"[{result.decoded_tokens} tokens in {result.denoise_forwards} denoising + "
        f"{result.commit_forwards} commit forwards; {result.tokens_per_forward:.2f} tokens/forward]",
        file=sys.stderr,
    )


def cmd_bench(args) -> None:
    raise DiffulexEdgeError(BENCH_MOVED)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help; an option whose help already states its default
    (one that depends on the model) is left as written."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``diffulex-edge`` parser, its subcommands and their options.

    Returns:
        The parser; each subcommand sets ``func``, the function that runs it.
    """
    formatter = _HelpFormatter
    parser = argparse.ArgumentParser(
        prog="diffulex-edge", description=__doc__, formatter_class=formatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "export", help="export a model to an ExecuTorch .pte (XNNPACK)", formatter_class=formatter
    )
    _add_source(p, with_pte=False)
    p.add_argument("-o", "--output", required=True, help="the .pte to write")
    p.add_argument(
        "--variant",
        choices=sorted(EXPORT_VARIANTS),
        default="block_kv",
        help="the graph (EXPORT_VARIANTS)",
    )
    p.add_argument(
        "--max-seq",
        type=int,
        default=None,
        help="static cache length, at most the model's max_position_embeddings (default: 64 "
        "for SDAR, 256 for a model without a mask token; never above the model's maximum)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per block (default: 4 for SDAR, 1 for a model without a mask token)",
    )
    p.add_argument(
        "--prefill-size",
        type=int,
        default=None,
        help="tokens per causal prefill chunk (0 = none; block_kv: a second method; "
        "static_kv: forward itself takes 1 to this many tokens, block size 1 only) "
        "(default: 32 for a model without a mask token, none for SDAR)",
    )
    p.add_argument(
        "--quantize", choices=QUANTIZATIONS, default=None, help="weights (default: fp32)"
    )
    p.add_argument(
        "--calibration",
        help="a UTF-8 text file that --quantize's int4 clipping is calibrated on (default: "
        "the package's calibration text, encoded by the model's tokenizer; random token ids "
        "where the model has no tokenizer)",
    )
    p.add_argument(
        "--tokenizer",
        help="a Hugging Face model directory with a tokenizer.json, or a .gguf file, that "
        "encodes the calibration text (default: MODEL_DIR's or --gguf's, when there is one)",
    )
    p.add_argument(
        "--no-grid",
        action="store_true",
        help="with --quantize, round int4 layers already on a 4-bit grid (a GGUF's Q4_0/Q4_1) "
        "again instead of keeping their grid: a smaller, faster program that scores worse "
        "(SmolLM2: the README's quantization table)",
    )
    p.add_argument(
        "--grid",
        metavar="LAYERS",
        help="with --quantize, the layers that keep a 4-bit grid they are found on, by the "
        "last part of their name, comma-separated, or 'all' (default: v_proj,o_proj,"
        "down_proj; each kept grid adds two small int8 products to its layer)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "generate", help="block-diffusion generation (eager or .pte)", formatter_class=formatter
    )
    _add_source(p, with_pte=True)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt", help="text (with a tokenizer), else digits for the sorting model, e.g. 31415926"
    )
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 3,1,4,10")
    p.add_argument(
        "--tokenizer",
        help="a Hugging Face model directory with a tokenizer.json, or a .gguf file, that "
        "encodes --prompt and decodes the answer (default: MODEL_DIR's or --gguf's, when "
        "there is one)",
    )
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    p.add_argument(
        "--allow-unverified",
        action="store_true",
        help="run a .pte that has no integrity record or fails it (a damaged program can "
        "crash the process)",
    )
    p.add_argument("--max-new-tokens", type=int, default=12, help="at most this many tokens")
    p.add_argument("--block-size", type=int, default=4, help="eager only; a .pte fixes its own")
    p.add_argument(
        "--remasking",
        choices=sorted(REMASKING),
        default="low_confidence_dynamic",
        help="which masked positions a denoising step fills (REMASKING)",
    )
    p.add_argument("--threshold", type=float, default=0.9, help="low_confidence_dynamic's bar")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    p.add_argument("--seed", type=int, default=None, help="for sampling (default: unseeded)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "bench",
        help="moved out of the package in 0.10.0: says what to run from a repository checkout",
        formatter_class=formatter,
    )
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``diffulex-edge`` command.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 2 after a one-line ``diffulex-edge: error: ...`` on stderr
        for an expected failure (a bad value, a missing or damaged file).
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # bench's old options are let through, so that it says where they go now.
    if unknown and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        args.func(args)
    except (ValueError, OSError) as err:
        # Expected failures (DiffulexEdgeError is a ValueError: a bad value, a damaged or
        # foreign file, a program ExecuTorch would not load; OSError: a missing file): one
        # line, exit status 2, as argparse reports a bad argument.
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
