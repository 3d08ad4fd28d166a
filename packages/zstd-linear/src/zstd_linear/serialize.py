"""save_compressed / load_compressed: a compressed model's Linear layers to and from disk."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from zstd_linear.decoder import check_threads
from zstd_linear.errors import CompressedFileError
from zstd_linear.fileformat import read_file, write_file
from zstd_linear.layer import CompressedLinear
from zstd_linear.model import RUNTIME_ATTR, install, report_of, runtime_of
from zstd_linear.policies import POLICIES
from zstd_linear.report import CompressionReport


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_compressed(model: nn.Module, path: str | os.PathLike) -> None:
    """Write every CompressedLinear of ``model`` (with its bias) to ``path`` (.zlin)."""
    runtime = runtime_of(model)
    write_file(path, [(name, lyr.encoded, lyr.bias) for name, lyr in runtime.layers.items()])


def load_compressed(
    path: str | os.PathLike,
    model: nn.Module,
    policy: str = "per_pass_prefetch",
    *,
    threads: int | None = None,
    **policy_options,
) -> CompressionReport:
    """Replace the nn.Linear layers of ``model`` named in ``path`` by CompressedLinear.

    Each named module must be an nn.Linear of the file's shape, dtype and bias (dtype
    included); the file is fully verified (every weight decoded once against its
    checksum) and every layer checked before ``model`` changes. A damaged file, or one
    that does not fit ``model``, raises CompressedFileError (a ValueError).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if RUNTIME_ATTR in model.__dict__:
        raise ValueError("model is already compressed: call decompress_model first")
    # Arguments first: reading verifies every weight, too long to waste on a typo.
    threads = check_threads(threads)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    entries = read_file(path, threads=threads)
    modules = dict(model.named_modules())
    layers: dict[str, CompressedLinear] = {}
    for name, encoded, bias in entries:
        target = modules.get(name)
        if not isinstance(target, nn.Linear):
            found = "nothing" if target is None else type(target).__name__
            raise CompressedFileError(
                f"layer {name!r} of {path} must name an nn.Linear in model, found {found}"
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
    install(model, layers, policy, threads, policy_options)
    return report_of(layers.values(), {})
