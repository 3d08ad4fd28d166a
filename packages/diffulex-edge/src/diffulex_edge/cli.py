"""``diffulex-edge export | generate | bench``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diffulex_edge.checkpoint import load_checkpoint
from diffulex_edge.config import tiny_config
from diffulex_edge.export import EXPORT_VARIANTS, QUANTIZATIONS
from diffulex_edge.generate import GenerationConfig
from diffulex_edge.remasking import REMASKING
from diffulex_edge.sampling import SamplingConfig
from diffulex_edge.task import TRAINED, trained_checkpoint

__all__ = ["build_parser", "main", "trained_checkpoint"]

# Defaults by model kind: SDAR decodes blocks of 4; an autoregressive model (no mask token)
# decodes one token per forward and prefills its prompt in chunks.
DIFFUSION_DEFAULTS = {"block_size": 4, "max_seq": 64, "prefill_size": None}
AUTOREGRESSIVE_DEFAULTS = {"block_size": 1, "max_seq": 256, "prefill_size": 32}


TINY_NOTE = (
    "diffulex-edge: note: --tiny is a seeded random model (untrained weights): its tokens "
    "are noise, for checking the pipeline, not for reading"
)


def _model(args):
    from diffulex_edge.model import random_model

    if args.tiny:
        print(TINY_NOTE, file=sys.stderr)
        return random_model(tiny_config(), seed=0)
    if args.gguf:
        from diffulex_edge.hf_import import load_gguf

        return load_gguf(args.gguf)
    return load_checkpoint(args.model_dir or args.checkpoint or trained_checkpoint())


def _add_source(p, with_pte: bool) -> None:
    p.add_argument(
        "model_dir",
        nargs="?",
        help="Hugging Face-layout directory (config.json + safetensors): SDAR or a family "
        "of the README's supported models except Phi-3 (fused tensors) (default: the "
        f"bundled trained sorting model, {TRAINED})",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--checkpoint", help="the same as MODEL_DIR")
    group.add_argument("--gguf", help="a GGUF file (dequantised by transformers; the hf extra)")
    group.add_argument(
        "--tiny", action="store_true", help="a seeded random tiny config (untrained: noise)"
    )
    if with_pte:
        group.add_argument("--pte", help="an exported diffulex-edge .pte")
    p.epilog = f"With no source, the bundled trained model ({TRAINED}) is used."


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
    from diffulex_edge.task import encode

    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",")]
        except ValueError as err:
            msg = f"--prompt-ids must be comma-separated ints, got {args.prompt_ids!r}"
            raise ValueError(msg) from err
    if tokenizer is None:
        return encode(args.prompt)
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens: add none (some tokenizers add a BOS).
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def cmd_export(args) -> None:
    from diffulex_edge.export import export_pte

    model = _model(args)
    defaults = AUTOREGRESSIVE_DEFAULTS if model.config.mask_token_id is None else DIFFUSION_DEFAULTS
    block_size = defaults["block_size"] if args.block_size is None else args.block_size
    max_seq = defaults["max_seq"] if args.max_seq is None else args.max_seq
    prefill = defaults["prefill_size"] if args.prefill_size is None else args.prefill_size or None
    if args.prefill_size is None and (args.variant == "cache_io" or block_size != 1):
        prefill = None  # the default only; an explicit --prefill-size is refused by export_pte
    result = export_pte(
        model, args.output, max_seq, block_size, args.variant, args.quantize, prefill, progress=True
    )
    print(
        f"wrote {result.path} ({result.pte_bytes / 2**20:.2f} MiB, {result.variant}, "
        f"block size {block_size}, prefill chunk {prefill}, "
        f"static KV {result.layout.nbytes} bytes = {result.layout.shape})"
    )


def cmd_generate(args) -> None:
    from diffulex_edge.task import decode

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
            "trained on (the bundled sorting model: 8 digits, then the separator 10, e.g. "
            "--prompt-ids 3,1,4,1,5,9,2,6,10 or --prompt 31415926)",
            file=sys.stderr,
        )
    if args.prompt is None:
        print(result.tokens)
    elif tokenizer is not None:
        print(tokenizer.decode(result.tokens, skip_special_tokens=True))
    else:
        print(decode(result.tokens))
    print(
        f"[{result.decoded_tokens} tokens in {result.denoise_forwards} denoising + "
        f"{result.commit_forwards} commit forwards; {result.tokens_per_forward:.2f} tokens/forward]",
        file=sys.stderr,
    )


def cmd_bench(args) -> None:
    import tempfile

    import torch

    from diffulex_edge.backends import EagerDynamic
    from diffulex_edge.export import export_pte
    from diffulex_edge.runtime import PteEngine
    from diffulex_edge.task import run_sort_task, sort_prompts

    torch.set_num_threads(args.threads)
    model = load_checkpoint(trained_checkpoint())
    c = model.config
    prompts = sort_prompts(args.prompts)
    config = GenerationConfig(max_new_tokens=12, remasking=args.remasking)
    with tempfile.TemporaryDirectory() as tmp:
        export_pte(model, Path(tmp) / "m.pte", 32, 4, "block_kv")
        engine = PteEngine(Path(tmp) / "m.pte", expected_config=c)
        for name, backend in (("eager", EagerDynamic(model, 4)), ("pte", engine.backend)):
            run_sort_task(backend, prompts[:1], config, c.mask_token_id, c.eos_token_id)  # warm-up
            r = run_sort_task(backend, prompts, config, c.mask_token_id, c.eos_token_id)
            print(
                f"{name:5s} {r.tokens_per_s:8.1f} tokens/s  {r.tokens_per_forward:.2f} tokens/forward"
                f"  exact match {r.exact_match:.3f}"
            )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in --help; an option whose help already states its default
    (one that depends on the model) is left as written."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
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
        "bench", help="eager vs .pte decode speed on the bundled model", formatter_class=formatter
    )
    p.add_argument("--prompts", type=int, default=20, help="random 8-digit prompts")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for eager")
    p.add_argument(
        "--remasking",
        choices=sorted(REMASKING),
        default="low_confidence_dynamic",
        help="REMASKING",
    )
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
