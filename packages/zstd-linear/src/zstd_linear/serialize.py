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
from zstd_linear.model import (
    RUNTIME_ATTR,
    check_uncompressed,
    install,
    own_forward,
    report_of,
    runtime_of,
    tied_to,
)
from zstd_linear.policies import check_policy
from zstd_linear.pretrained import build_model, check_filled, save_companion


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_compressed(
    model: nn.Module, path: str | os.PathLike, *, source: str | os.PathLike | None = None
) -> None:
    """Write a compressed model to ``path`` (.zlin) and, for a transformers model, the
    rest of it beside it.

    Every CompressedLinear (with its bias) and CompressedEmbedding goes to ``path``; a
    tied lm_head is not written, its table is the embedding's. For a model with a
    ``config`` (transformers), the other tensors (norms, any Linear left plain) and the
    config go to ``<path>.safetensors``, so that ``load_compressed(path)`` builds the
    model alone. Both files are written to a temporary name and renamed.

    Args:
        model: a compressed model.
        path: the .zlin file to write; replaced if it exists.
        source: the model directory or GGUF file it came from, recorded in the
            companion for ``zstd-linear run``'s tokenizer.

    Raises:
        ZstdLinearError: ``model`` is not compressed.
        OSError: the file cannot be written.
    """
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
    """Build the model of ``path``, or put the layers of ``path`` into ``model``.

    The .zlin file is memory-mapped: its compressed frames stay file-backed pages,
    which a memory limit can evict. The file is fully verified (every weight decoded
    once against its checksum) and every layer checked against the model before the
    model changes. A name in the file may be an nn.Embedding (a file written after
    ``compress_model(..., embeddings=True)``): it becomes a CompressedEmbedding, and
    every Linear tied to it (SmolLM2's lm_head) a CompressedLinear over the same frames.

    Args:
        path: a .zlin file written by ``save_compressed``.
        model: None to build the model with transformers' ``AutoModelForCausalLM.
            from_config`` from the config in ``<path>.safetensors``, every parameter on
            the meta device, so the plain model is never materialised (needs
            ``zstd-linear[hf]``). Or a model (0.2's form) whose nn.Linear layers named
            in the file, each of the file's shape, dtype and bias, are replaced in
            place.
        policy: a ``POLICIES`` name.
        threads: decode threads (default min(2, cores)).
        **policy_options: the policy's options, as for ``compress_model``.

    Returns:
        Without ``model``: the model, in eval mode. With ``model``: the
        CompressionReport of the layers put in.

    Raises:
        ZstdLinearError: a bad argument (the policy name and threads are checked
            before the file is read, policy options before the model changes), or
            ``model`` is already compressed.
        CompressedFileError: ``path`` or its companion is damaged, of another version,
            or does not fit ``model``; ``model`` is unchanged.
        FileNotFoundError: ``path`` does not exist.
        ImportError: ``model`` is None and transformers is not installed.
    """
    build = model is None
    if not build:
        check_uncompressed(model)
    # Arguments first: reading verifies every weight, too long to waste on a typo.
    threads = check_threads(threads)
    check_policy(policy)
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
        else:
            layers[name] = _linear(path, name, encoded, bias, modules)
    _add_tied_heads(path, model, layers, tables)
    install(model, layers, policy, threads, policy_options, tables)
    if build:
        check_filled(model, path)
        return model
    return report_of(model.__dict__[RUNTIME_ATTR].stored_weights(), {})


def _linear(path, name: str, encoded, bias, modules: dict[str, nn.Module]) -> CompressedLinear:
    """The CompressedLinear of the file's layer ``name``, checked against the model's."""
    target = modules.get(name)
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
    return CompressedLinear(encoded, bias, name)


def _add_tied_heads(
    path, model: nn.Module, layers: dict[str, CompressedLinear], tables: dict
) -> None:
    """Add to ``layers`` a CompressedLinear over each of ``tables``' frames for every
    Linear tied to it (a tied lm_head), which the file does not hold itself."""
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
                "then save_compressed; or zstd_linear.fileformat.write_file(path, the read_file "
                "entries you keep)"
            )
    return ""
