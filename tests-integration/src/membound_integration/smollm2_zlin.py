"""The embedded SmolLM2-135M with its Linear layers read from a cached zstd-linear file.

Compressing all 210 Linear layers takes tens of seconds and holds the plain weights and the
compressed ones at once; loading the ``.zlin`` file does neither. The file is built once
(``compress_model`` + ``save_compressed``, which writes atomically) and kept under
``$MEMBOUND_CACHE`` (default ``~/.cache/membound``) next to the float copy it came from.
"""

from __future__ import annotations

from pathlib import Path


def compressed_smollm2_path(progress: bool = False) -> Path:
    """Path of the .zlin file holding every Linear of SmolLM2-135M (float32) and its
    embedding table, which the tied lm_head shares (``compress_model(embeddings=True)``)."""
    import zstd_linear
    from membound_testing import load_smollm2, smollm2_float_dir
    from membound_testing.models import cache_dir
    from zstd_linear.fileformat import FORMAT_VERSION
    from zstd_linear.pretrained import companion_path

    source = smollm2_float_dir()
    # Keyed by the float copy and by zstd-linear's version and file format, so a new codec
    # or model copy never reads a stale file.
    path = cache_dir() / (
        f"{source.name}-zstd-linear-{zstd_linear.__version__}-v{FORMAT_VERSION}.zlin"
    )
    if not (path.is_file() and companion_path(path).is_file()):
        model, _ = load_smollm2()
        zstd_linear.compress_model(model, progress=progress, embeddings=True)
        zstd_linear.save_compressed(model, path)
    return path


def load_compressed_smollm2(policy: str = "per_pass_prefetch", **policy_options):
    """(model, tokenizer, report): SmolLM2-135M built from the .zlin file alone.

    ``load_compressed(path)`` builds the model on the meta device from the config kept
    beside the file and fills it from the two mapped files (the compressed Linear layers
    and embedding, which the tied lm_head shares; the norms): the plain model is never
    materialised and the compressed bytes are file-backed pages.
    """
    from transformers import PreTrainedTokenizerFast

    import zstd_linear
    from membound_testing import smollm2_float_dir

    model = zstd_linear.load_compressed(compressed_smollm2_path(), policy=policy, **policy_options)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(smollm2_float_dir()))
    return model, tokenizer, zstd_linear.compression_report(model)


def attention_zlin_path() -> Path:
    """A .zlin file with only the attention projections (q, k, v, o) of every layer (no
    embedding).

    For models whose MLPs another package replaces first (paired-cache's SparseMLP), so
    that load_compressed finds an nn.Linear for every layer in the file. Cut from the
    full file with zstd-linear's own reader and writer (no re-encoding).
    """
    from zstd_linear.fileformat import read_file, write_file

    full = compressed_smollm2_path()
    path = full.with_name(full.stem + "-attention.zlin")
    if not path.is_file():
        entries = read_file(full)
        write_file(path, [e for e in entries if ".self_attn." in e[0]])
    return path
