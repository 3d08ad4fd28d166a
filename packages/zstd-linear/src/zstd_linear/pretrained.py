"""A whole model from a .zlin file: the rest of the model (norms, config) in a safetensors
file beside it, the model built on the meta device and filled from both files, mapped.

``save_compressed`` of a Hugging Face model writes ``<path>.safetensors`` next to
``<path>``: every tensor of the state dict that no compressed module holds, and the
model's config (JSON) in the safetensors metadata under ``zstd_linear_config``, with its
attention implementation under ``zstd_linear_attn_implementation`` (the config's JSON
leaves it out, and eager and sdpa attention round differently).
``build_model`` builds ``AutoModelForCausalLM.from_config`` with every parameter on the
meta device (the plain model is never materialised), assigns the companion's tensors as
views of a private read-only-in-practice mapping (file-backed pages until written), and
hands the model to ``load_compressed`` for the compressed modules.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from zstd_linear.aligned_safetensors import DTYPES, PAD_PREFIX, write_aligned
from zstd_linear.errors import CompressedFileError
from zstd_linear.fileformat import umask_mode

CONFIG_KEY = "zstd_linear_config"
SOURCE_KEY = "zstd_linear_source"
ATTN_KEY = "zstd_linear_attn_implementation"


def companion_path(path: str | os.PathLike) -> Path:
    """Where the rest of a .zlin file's model is kept.

    Args:
        path: the .zlin file.

    Returns:
        ``<path>.safetensors``, beside it.
    """
    path = Path(path)
    return path.with_name(path.name + ".safetensors")


def save_companion(
    model: nn.Module, path: str | os.PathLike, stored: set[str], source=None
) -> None:
    """Write the state-dict tensors of ``model`` outside the modules named in ``stored``,
    with its config (and ``source``, if given), to ``companion_path(path)`` (temporary
    name, then rename), every tensor 64-byte aligned in the file (aligned_safetensors)."""
    config = model.config.to_dict()
    tensors = {}
    seen: set[int] = set()
    for key, tensor in _plain_state_dict(model, stored).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[key] = tensor.detach().to("cpu").contiguous()
    target = companion_path(path)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        metadata = {
            CONFIG_KEY: json.dumps(config),
            ATTN_KEY: json.dumps(getattr(model.config, "_attn_implementation", None)),
        }
        if source is not None:
            metadata[SOURCE_KEY] = str(Path(source).resolve())
        write_aligned(tmp, tensors, metadata)
        os.chmod(tmp, umask_mode())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plain_state_dict(model: nn.Module, stored: set[str]) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the modules named in ``stored`` (the compressed
    ones, whose state_dict refuses: their weights are in the .zlin file)."""
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if name not in stored:
            # keep_vars: the parameters themselves, so that a tie shows as one object.
            module._save_to_state_dict(state, f"{name}." if name else "", True)
    return state


def recorded_source(path: str | os.PathLike) -> str | None:
    """The model directory or GGUF file that ``path`` (.zlin) was compressed from, as
    ``zstd-linear compress`` recorded it; None if not recorded."""
    from safetensors import safe_open

    companion = companion_path(path)
    if not companion.is_file():
        return None
    with safe_open(str(companion), framework="pt") as f:
        return (f.metadata() or {}).get(SOURCE_KEY)


def _read_companion(path: Path) -> tuple[dict, str | dict | None, dict[str, torch.Tensor]]:
    """(config dict, attention implementation (None where the file does not record it:
    transformers' default), name -> tensor viewing a private mapping of the file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:  # validates the header
            metadata = f.metadata() or {}
    except Exception as exc:  # safetensors raises its own error types
        raise CompressedFileError(f"{path}: not a valid safetensors file ({exc})") from None
    if CONFIG_KEY not in metadata:
        raise CompressedFileError(
            f"{path}: no model config in its metadata (key {CONFIG_KEY!r}); it was not "
            "written by save_compressed"
        )
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        # ACCESS_COPY: a private mapping torch may view as writable; its pages stay
        # file-backed (evictable) unless something writes to them.
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + header_len
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__" or name.startswith(PAD_PREFIX):
            continue
        if spec["dtype"] not in DTYPES:
            raise CompressedFileError(
                f"{path}: tensor {name!r} has unsupported dtype {spec['dtype']}"
            )
        lo, hi = spec["data_offsets"]
        dtype = DTYPES[spec["dtype"]]
        if hi == lo:
            tensors[name] = torch.empty(spec["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=hi - lo, offset=start + lo)
        tensors[name] = flat.view(dtype).view(spec["shape"])
    attn = _attn_implementation(path, metadata.get(ATTN_KEY, "null"))
    return json.loads(metadata[CONFIG_KEY]), attn, tensors


def _attn_implementation(path: Path, text: str) -> str | dict | None:
    """The recorded attention implementation (a companion from before 0.10 has none)."""
    try:
        value = json.loads(text)
        valid = value is None or isinstance(value, (str, dict))
    except json.JSONDecodeError:
        valid = False
    if not valid:
        raise CompressedFileError(
            f"{path}: {ATTN_KEY} must be a JSON string, object or null, got {text!r}"
        )
    return value


@contextmanager
def _parameters_on_meta():
    """Register every new parameter on the meta device (buffers stay real: rotary
    frequencies are computed, not loaded). The CPU tensor a constructor makes first is
    never written, so it costs no resident memory."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # a tie re-registers a meta one
            param = module._parameters[name]
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_model(path: str | os.PathLike) -> nn.Module:
    """The model of the .zlin file ``path``: its non-compressed tensors filled from the
    companion file, every compressed module's parameters still on the meta device."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ImportError(
            "load_compressed without a model builds one with transformers: "
            "pip install 'zstd-linear[hf]'"
        ) from None
    if not Path(path).is_file():
        raise FileNotFoundError(errno.ENOENT, "no such .zlin file", str(path))
    companion = companion_path(path)
    if not companion.is_file():
        raise CompressedFileError(
            f"{path}: no {companion.name} beside it (the model's config and non-compressed "
            "tensors, written by save_compressed of a transformers model); pass model= "
            "to load into a model you built"
        )
    config_dict, attn, tensors = _read_companion(companion)
    config = AutoConfig.for_model(**config_dict)
    # The saved model's attention kernel, so that the logits are its logits bit for bit.
    options = {} if attn is None else {"attn_implementation": attn}
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype, **options)
    model.eval()
    expected = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    unknown = sorted(set(tensors) - expected - set(dict(model.named_buffers())))
    if unknown:
        raise CompressedFileError(f"{companion}: tensors the model does not have: {unknown[:5]}")
    # A tie (lm_head = embed_tokens) is one parameter under several names, saved once;
    # assign=True replaces that one name's parameter, so the others are pointed at it.
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    model.load_state_dict(tensors, strict=False, assign=True)
    for names in tied.values():
        saved = [n for n in names if n in tensors]
        if len(names) > 1 and saved:
            param = model.get_parameter(saved[0])
            for name in names:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, param)
    return model


def check_filled(model: nn.Module, path) -> None:
    """Every parameter must be real once the compressed modules are in."""
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CompressedFileError(
            f"{path} and its companion leave {len(missing)} parameters unset, e.g. {missing[:3]}"
        )
