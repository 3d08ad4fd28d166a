"""``zstd-linear compress | run | inspect | bench``."""

from __future__ import annotations

import argparse
import errno
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatchcase
from pathlib import Path

import torch

from zstd_linear.codec import DEFAULT_CHUNK_BYTES, DEFAULT_LAYOUT, CodecConfig, encode_weight
from zstd_linear.decoder import Decoder, default_threads
from zstd_linear.errors import ZstdLinearError
from zstd_linear.fileformat import read_file, write_file
from zstd_linear.layout import LAYOUTS, SUPPORTED_DTYPES
from zstd_linear.model import compress_model, compression_stats
from zstd_linear.policies import POLICIES
from zstd_linear.pretrained import companion_path, recorded_source
from zstd_linear.progress import ProgressBar
from zstd_linear.report import CompressionReport, LayerReport
from zstd_linear.serialize import load_compressed, save_compressed


def _safetensors_files(src: Path) -> list[Path]:
    files = sorted(src.glob("*.safetensors")) if src.is_dir() else [src]
    if not files or not all(f.is_file() for f in files):
        raise ZstdLinearError(
            f"SRC must be a .safetensors file or a directory holding some, got {src}"
        )
    return files


def _load_linear_tensors(src: Path, include: list[str], exclude: list[str]):
    """name -> (weight, bias or None) for 2-D float ``<name>.weight`` tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(src):
        try:
            tensors.update(load_file(str(f)))
        except SafetensorError as exc:
            raise ZstdLinearError(
                f"{f} is not a safetensors file ({exc}); SRC must be a Hugging Face model "
                "directory (config.json), a .gguf file, or .safetensors files"
            ) from None
    floats = {t for t, _ in SUPPORTED_DTYPES.values()}
    chosen = {}
    for key, tensor in tensors.items():
        if not key.endswith(".weight") or tensor.dim() != 2 or tensor.dtype not in floats:
            continue
        name = key.removesuffix(".weight")
        if include and not any(fnmatchcase(name, p) for p in include):
            continue
        if any(fnmatchcase(name, p) for p in exclude):
            continue
        chosen[name] = (tensor, tensors.get(f"{name}.bias"))
    if not chosen:
        raise ZstdLinearError(f"no 2-D float '*.weight' tensor in {src} matches the filters")
    return chosen


def _is_model_source(src: Path) -> bool:
    return (src.is_dir() and (src / "config.json").is_file()) or src.suffix == ".gguf"


def _load_model(src: Path):
    """A transformers model (and the source to record) from an HF directory or a GGUF
    file (transformers dequantises GGUF to float32)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ZstdLinearError(
            "compressing a model directory or GGUF needs transformers: "
            "pip install 'zstd-linear[hf]'"
        ) from None
    if not src.exists():
        raise ZstdLinearError(f"SRC {src} does not exist")
    if src.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(src))
    return model.eval()


def _compress_model_source(args, src: Path) -> int:
    print(f"loading {src} with transformers ...", file=sys.stderr, flush=True)
    model = _load_model(src)
    report = compress_model(
        model,
        include=args.include or None,
        exclude=args.exclude,
        level=args.level,
        layout=args.layout,
        chunk_bytes=args.chunk_kib * 1024,
        threads=args.threads,
        progress=True,
        embeddings=True,
        policy="none",
    )
    save_compressed(model, args.out, source=src)
    print(
        f"{len(report.layers)} layers, {report.original_bytes} -> {report.compressed_bytes} "
        f"bytes (ratio {report.ratio:.3f}) written to {args.out} (+ {companion_path(args.out).name})"
    )
    return 0


def cmd_compress(args) -> int:
    src = Path(args.src)
    if not src.exists():
        raise FileNotFoundError(errno.ENOENT, "no such model directory or file", str(src))
    if _is_model_source(src):
        return _compress_model_source(args, src)
    config = CodecConfig(level=args.level, layout=args.layout, chunk_bytes=args.chunk_kib * 1024)
    tensors = _load_linear_tensors(Path(args.src), args.include, args.exclude)
    bar = ProgressBar(len(tensors))
    entries = []
    with ThreadPoolExecutor(args.threads) as pool:
        encoded = pool.map(lambda item: encode_weight(item[0], config), tensors.values())
        for (name, (_, bias)), enc in zip(tensors.items(), encoded, strict=True):
            entries.append((name, enc, bias))
            bar.advance(name)
    write_file(args.out, entries)
    report = _report(entries)
    print(
        f"{len(entries)} layers, {report.original_bytes} -> {report.compressed_bytes} bytes "
        f"(ratio {report.ratio:.3f}) written to {args.out}"
    )
    return 0


def _report(entries) -> CompressionReport:
    return CompressionReport(
        [
            LayerReport(name, e.dtype, e.shape, e.layout, e.original_bytes, e.compressed_bytes)
            for name, e, _ in entries
        ]
    )


def cmd_run(args) -> int:
    model = load_compressed(args.file, policy=args.policy, threads=args.threads)
    tokenizer = _tokenizer(args)
    text = args.prompt
    if args.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
    ids = tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    stats = compression_stats(model)
    print(
        f"[{stats.forward_passes} passes, {stats.decompressions_per_pass:.0f} decodes/pass, "
        f"decoded {stats.peak_decoded_bytes / 2**20:.1f} MiB peak (anonymous), compressed "
        f"{stats.compressed_file_bytes / 2**20:.1f} MiB file-backed]",
        file=sys.stderr,
    )
    return 0


def _tokenizer(args):
    from transformers import AutoTokenizer

    if args.tokenizer:
        return AutoTokenizer.from_pretrained(args.tokenizer)
    source = recorded_source(args.file)
    if source is None:
        raise ZstdLinearError(f"{args.file} records no source model: pass --tokenizer DIR")
    path = Path(source)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def cmd_inspect(args) -> int:
    print(_report(read_file(args.file)).table())
    return 0


def cmd_bench(args) -> int:
    entries = read_file(args.file)
    decoder = Decoder(args.threads)
    buffers = [torch.empty(e.original_bytes, dtype=torch.uint8) for _, e, _ in entries]
    total = sum(e.original_bytes for _, e, _ in entries)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for (_, encoded, _), buf in zip(entries, buffers, strict=True):
            decoder.decode_into(encoded, buf)
        times.append(time.perf_counter() - start)
    decoder.close()
    median = statistics.median(times)
    report = _report(entries)
    print(
        f"{len(entries)} layers, {total / 1e6:.1f} MB decoded, ratio {report.ratio:.3f}, "
        f"{args.threads} threads: median {median * 1e3:.1f} ms = {total / median / 1e9:.2f} GB/s "
        f"over {args.repeats} runs"
    )
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every default but for required options and those with none (None, [])."""

    def _get_help_string(self, action):
        if action.required or action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zstd-linear",
        description="Lossless zstd-compressed Linear weights.",
        formatter_class=_HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser(
        "compress",
        formatter_class=_HelpFormatter,
        help="compress a model (HF directory or GGUF: Linear layers and embeddings, loadable "
        "alone) or the Linear weights of a safetensors checkpoint",
    )
    c.add_argument(
        "src",
        help="a Hugging Face model directory (config.json), a .gguf file, or a "
        ".safetensors file / directory of them (tensors only)",
    )
    c.add_argument("out", help="the .zlin file to write")
    c.add_argument(
        "--include",
        action="append",
        default=[],
        help="compress only layers matching this glob (repeatable; default: every one)",
    )
    c.add_argument(
        "--exclude",
        action="append",
        default=[],
        help="skip layers matching this glob, e.g. '*embed*'",
    )
    c.add_argument("--level", type=int, default=3, help="zstd level")
    c.add_argument(
        "--layout",
        choices=["auto", *sorted(LAYOUTS)],
        default=DEFAULT_LAYOUT,
        help="byte-plane layout (auto: exponent-mantissa for bfloat16, exponent otherwise)",
    )
    c.add_argument(
        "--chunk-kib",
        type=int,
        default=DEFAULT_CHUNK_BYTES // 1024,
        help="chunk size in KiB (the unit of parallel decoding)",
    )
    c.add_argument("--threads", type=int, default=default_threads(), help="encoding threads")
    c.set_defaults(func=cmd_compress)
    r = sub.add_parser(
        "run",
        help="greedy generation from a .zlin file and its companion",
        formatter_class=_HelpFormatter,
    )
    r.add_argument("file", help="a .zlin file written with its companion .safetensors")
    r.add_argument("--prompt", required=True, help="the text to continue (or to answer)")
    r.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    r.add_argument(
        "--policy", choices=sorted(POLICIES), default="per_pass_prefetch", help="caching policy"
    )
    r.add_argument("--threads", type=int, default=default_threads(), help="decoding threads")
    r.add_argument("--tokenizer", help="tokenizer directory (default: the recorded source)")
    r.add_argument("--chat", action="store_true", help="apply the chat template")
    r.set_defaults(func=cmd_run)
    i = sub.add_parser(
        "inspect", help="per-layer table of a .zlin file", formatter_class=_HelpFormatter
    )
    i.add_argument("file", help="a .zlin file")
    i.set_defaults(func=cmd_inspect)
    b = sub.add_parser(
        "bench", help="decode throughput of a .zlin file", formatter_class=_HelpFormatter
    )
    b.add_argument("file", help="a .zlin file")
    b.add_argument("--threads", type=int, default=default_threads(), help="decoding threads")
    b.add_argument("--repeats", type=int, default=5, help="timed runs (the median is shown)")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, ImportError) as exc:
        # Expected failures (a bad or damaged file, a missing one, a missing extra; the
        # package's ZstdLinearError and its subclasses are ValueErrors, as are the
        # transformers loaders' refusals): one line, exit 2, as argparse reports a bad
        # argument.
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
