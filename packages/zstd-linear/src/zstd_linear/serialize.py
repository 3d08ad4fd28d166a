"""save_compressed / load_compressed: a compressed model's Linear layers to and from disk."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from zstd_linear.decoder import check_threads
from zstd_linear.embedding import CompressedEmbedding
from zstd_linear.errors import CompressedFileError
from zstd_linear.fileformat import read_file, write_file
from zstd_linear.layer import CompressedLinear
from zstd_linear.model import RUNTIME_ATTR, install, own_forward, report_of, runtime_of, tied_to
from zstd_linear.policies import POLICIES
from zstd_linear.pretrained import build_model, check_filled, save_companion


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_compressed(
    model: nn.Module, path: str | os.PathLike, *, source: str | os.PathLike | None = None
) -> None:
    """Write every CompressedLinear (with its bias) and CompressedEmbedding of ``model``
    to ``path`` (.zlin). A tied lm_head is not written: its table is the embedding's.

    For a transformers model (one with a ``config``), the rest of it (norms, and any
    Linear left plain) and its config go to ``<path>.safetensors`` beside it, so that
    ``load_compressed(path)`` can build the model alone; ``source`` (the model directory
    or GGUF it came from) is recorded there for ``zstd-linear run``'s tokenizer."""
    runtime = runtime_of(model)
    write_file(
        path, [(m.name, m.encoded, getattr(m, "bias", None)) for m in runtime.stored_weights()]
    )
    if hasattr(getattr(model, "config", None), "to_dict"):
        save_companion(model, path, set(runtime.layers) | set(runtime.embeddings), source)


def load_compressed(
    path: str | os.PathLike,
    model: nn.Module | None = None,
    policy: str = "per_pass_prefetch",
    *,
    threads: int | None = None,
    **policy_options,
):
    """The model of ``path`` (model=None), or ``model`` with the layers of ``path`` in.

    Without ``model``: builds the model with transformers' ``AutoModelForCausalLM.
    from_config`` from the config kept in ``<path>.safetensors`` (written beside the
    .zlin file by ``save_compressed`` of a transformers model), every parameter on the
    meta device, so the plain model is never materialised; fills the non-compressed
    tensors (norms) as views of that file, mapped, and the compressed modules from
    ``path``; returns the model in eval mode (``compression_stats(model)``, and
    ``compressed_layers`` describe it). Needs ``zstd-linear[hf]``.

    With ``model`` (0.2's form): replaces its nn.Linear layers named in ``path`` by
    CompressedLinear, in place, and returns the CompressionReport.

    The file is memory-mapped: its compressed frames stay file-backed pages. A name
    may also be an nn.Embedding (a file written with ``compress_model(...,
    embeddings=True)``): it becomes a CompressedEmbedding, and every Linear tied to it
    (SmolLM2's lm_head) a CompressedLinear over the same frames. Each named Linear must
    be of the file's shape, dtype and bias (dtype included); the file is fully verified (every weight decoded once against its
    checksum) and every layer checked before ``model`` changes. A damaged file, or one
    that does not fit ``model``, raises CompressedFileError (a ValueError).
    """
    build = model is None
    if not build and not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not build and RUNTIME_ATTR in model.__dict__:
        raise ValueError("model is already compressed: call decompress_model first")
    # Arguments first: reading verifies every weight, too long to waste on a typo.
    threads = check_threads(threads)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    if build:
        model = build_model(path)
    entries = read_file(path, threads=threads)
    modules = dict(model.named_modules())
    layers: dict[str, CompressedLinear] = {}
    tables: dict[str, CompressedEmbedding] = {}
    for name, encoded, bias in entries:
        target = modules.get(name)
        if isinstance(target, nn.Embedding) and bias is None:
            tables[name] = _embedding(path, name, encoded, target)
            continue
        if not isinstance(target, nn.Linear):
            found = "nothing" if target is None else type(target).__name__
            raise CompressedFileError(
                f"layer {name!r} of {path} must name an nn.Linear (or an nn.Embedding) in "
                f"model, found {found}{_replaced_hint(modules, name)}"
            )
        want = (target.out_features, target.in_features)
        if encoded.shape != want:
            raise CompressedFileError(
                f"layer {name!r} of {path} has shape {encoded.shape}, the model's is {want}"
            )
        if target.weight.dtype != encoded.torch_dtype:
            raise CompressedFileError(
                f"layer {name!r} of {path} has dtype {encoded.dtype}, "
                f"the model's is {_name(target.weight.dtype)}"
            )
        if (bias is None) != (target.bias is None):
            raise CompressedFileError(
                f"layer {name!r} of {path} {'has no' if bias is None else 'has a'} bias, "
                f"the model's Linear {'has one' if bias is None else 'has none'}"
            )
        if bias is not None and bias.dtype != target.bias.dtype:
            raise CompressedFileError(
                f"layer {name!r} of {path} has a {_name(bias.dtype)} bias, "
                f"the model's is {_name(target.bias.dtype)}"
            )
        layers[name] = CompressedLinear(encoded, bias, name)
    for name, table in tables.items():
        for head in tied_to(model, name):
            if head in layers:
                raise CompressedFileError(
                    f"layer {head!r} of {path} is tied to the embedding {name!r}, which the "
                    "file also holds: a tied Linear is stored once, as its embedding"
                )
            if model.get_submodule(head).bias is not None:
                raise CompressedFileError(
                    f"layer {head!r} is tied to the embedding {name!r} of {path} but has a "
                    "bias, which the file does not hold"
                )
            layers[head] = CompressedLinear(table.encoded, None, head)
    install(model, layers, policy, threads, policy_options, tables)
    if build:
        check_filled(model, path)
        return model
    return report_of(model.__dict__[RUNTIME_ATTR].stored_weights(), {})


def _embedding(path, name: str, encoded, target: nn.Embedding) -> CompressedEmbedding:
    want = (target.num_embeddings, target.embedding_dim)
    if encoded.shape != want:
        raise CompressedFileError(
            f"embedding {name!r} of {path} has shape {encoded.shape}, the model's is {want}"
        )
    if target.weight.dtype != encoded.torch_dtype:
        raise CompressedFileError(
            f"embedding {name!r} of {path} has dtype {encoded.dtype}, "
            f"the model's is {_name(target.weight.dtype)}"
        )
    if target.max_norm is not None:
        raise CompressedFileError(
            f"embedding {name!r} of the model has max_norm (it renormalises rows): not supported"
        )
    reason = own_forward(target)
    if reason is not None:
        raise CompressedFileError(
            f"embedding {name!r} of {path} cannot replace the model's: {reason} "
            "(a CompressedEmbedding is a plain lookup)"
        )
    return CompressedEmbedding(encoded, name, target.padding_idx)


def _replaced_hint(modules: dict[str, nn.Module], name: str) -> str:
    """Where a layer of the file is missing because a module above it was replaced (another
    package's, such as paired-cache's SparseMLP over an MLP), what to do instead."""
    parent = name
    while "." in parent:
        parent = parent.rpartition(".")[0]
        module = modules.get(parent)
        if module is not None:
            if type(module).__module__.startswith(("torch.", "transformers.")):
                return ""
            return (
                f": {parent!r} is a {type(module).__name__}, which replaced the layers below "
                f"it. Write the file without them: compress_model(model, "
                f"exclude='*.{parent.rpartition('.')[2]}.*') before the other package's step, "
                "then save_compressed; or write_file(path, the read_file entries you keep)"
            )
    return ""
