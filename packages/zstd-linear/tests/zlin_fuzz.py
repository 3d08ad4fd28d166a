"""Fuzzing .zlin files: a header mutator that keeps the CRC right, a target writer, and
the checker that membound_testing.fuzz runs in its worker processes.

Used by tests/test_fuzz.py (a tiny file, in CI) and benchmarks/fuzz.py (MiniLM layers);
both put this directory on the worker's PYTHONPATH. A target is a directory holding
``model.zlin`` (the file that is damaged) and ``reference.safetensors`` (the weights and
biases as written), from which the checker builds a model of plain nn.Linear layers.
"""

from __future__ import annotations

import json
import random
import struct
import zlib
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from membound_testing import fuzz
from zstd_linear import load_compressed
from zstd_linear.codec import CodecConfig, encode_weight
from zstd_linear.fileformat import write_file
from zstd_linear.layout import LAYOUTS, SUPPORTED_DTYPES
from zstd_linear.model import compressed_layers

ZLIN = "model.zlin"
REFERENCE = "reference.safetensors"
PREFIX = struct.Struct("<8sIQI")  # magic, version, header_len, header_crc
CHECKER = "zlin_fuzz:check"
CLEAN_ERRORS = ["zstd_linear.CompressedFileError"]


def write_target(
    root: Path, layers: dict[str, tuple[torch.Tensor, torch.Tensor | None, CodecConfig]]
) -> fuzz.Target:
    """Write ``layers`` (name -> weight (out, in), bias (out,) or None, codec) to root."""
    root.mkdir(parents=True, exist_ok=True)
    entries, reference = [], {}
    for name, (weight, bias, config) in layers.items():
        entries.append((name, encode_weight(weight, config), bias))
        reference[f"{name}.weight"] = weight.contiguous()
        if bias is not None:
            reference[f"{name}.bias"] = bias.contiguous()
    write_file(root / ZLIN, entries)
    save_file(reference, str(root / REFERENCE))
    return fuzz.Target(root, ZLIN, structured=mutate_zlin_header, header_bytes=256)


def split(data: bytes) -> tuple[int, dict, bytes]:
    """(version, header, data section) of a .zlin file's bytes."""
    _, version, header_len, _ = PREFIX.unpack_from(data)
    header = json.loads(data[PREFIX.size : PREFIX.size + header_len])
    return version, header, data[PREFIX.size + header_len :]


def join(version: int, header: dict, body: bytes, magic: bytes = b"ZSTDLIN\0") -> bytes:
    """A .zlin file's bytes with ``header``, its length and CRC recomputed."""
    raw = json.dumps(header, allow_nan=True).encode()
    return PREFIX.pack(magic, version, len(raw), zlib.crc32(raw)) + raw + body


def _plausible(header: dict, rng: random.Random) -> dict:
    """Rewrite one field to a value that a valid file could hold: another layout or
    dtype, a moved record, another frame kind, a shifted offset."""
    layers = header["layers"]
    a, b = rng.choice(layers), rng.choice(layers)
    kind = rng.randrange(10)
    if kind == 0:
        a["layout"] = rng.choice([n for n in LAYOUTS if n != a["layout"]])
    elif kind == 1:
        a["dtype"] = rng.choice([n for n in SUPPORTED_DTYPES if n != a["dtype"]])
    elif kind == 2:
        a["shape"] = a["shape"][::-1] if rng.random() < 0.5 else list(b["shape"])
    elif kind == 3:
        a["name"], b["name"] = b["name"], a["name"]
    elif kind == 4:
        frames = [f for layer in layers for f in layer["frames"]]
        f, g = rng.choice(frames), rng.choice(frames)
        f[:], g[:] = list(g), list(f)
    elif kind == 5:
        f = rng.choice(a["frames"])
        f[2] = rng.choice([k for k in (0, 1, 2) if k != f[2]])  # zstd, raw, bitpack
    elif kind == 6:
        a["bias"], b["bias"] = b["bias"], a["bias"]
    elif kind == 7:
        a["chunk_elems"] = rng.choice([a["chunk_elems"] * 2, a["chunk_elems"] // 2, 1])
    elif kind == 8:
        a["weight_crc32"], b["weight_crc32"] = b["weight_crc32"], a["weight_crc32"]
    else:
        f = rng.choice(a["frames"])
        f[0] += rng.choice([-1, 1])
    return header


def mutate_zlin_header(data: bytes, rng: random.Random) -> bytes:
    """One header field rewritten (to an odd value, or to a plausible one) and the
    header's length and CRC-32 recomputed, so the field checks are what is tested."""
    version, header, body = split(data)
    if rng.random() < 0.5:
        header = fuzz.mutate_json(header, rng)
    else:
        header = _plausible(header, rng)
    return join(version, header, body)


def skeleton(reference: dict[str, torch.Tensor]) -> nn.Module:
    """A module tree with one nn.Linear per ``<name>.weight`` of ``reference``, of its
    shape and dtype (weights left uninitialised: the file must fill them)."""
    root = nn.Module()
    for key, weight in reference.items():
        if not key.endswith(".weight"):
            continue
        name = key.removesuffix(".weight")
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        out_features, in_features = weight.shape
        bias = f"{name}.bias" in reference
        with torch.device("meta"):
            linear = nn.Linear(in_features, out_features, bias=bias, dtype=weight.dtype)
        linear.weight = nn.Parameter(torch.empty_like(weight, device="cpu"), requires_grad=False)
        if bias:
            linear.bias = nn.Parameter(
                torch.empty_like(reference[f"{name}.bias"], device="cpu"), requires_grad=False
            )
        parent.add_module(leaf, linear)
    return root


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def check(path: str) -> bool:
    """Load ``path``/model.zlin into a fresh model; True iff every weight and bias
    decodes to the reference's bits (raises when load_compressed refuses)."""
    root = Path(path)
    reference = load_file(str(root / REFERENCE))
    model = skeleton(reference)
    load_compressed(root / ZLIN, model, policy="none", threads=1)
    layers = compressed_layers(model)
    names = {k.removesuffix(".weight") for k in reference if k.endswith(".weight")}
    if set(layers) != names:
        return False
    for name, layer in layers.items():
        if not same_bits(layer.weight, reference[f"{name}.weight"]):
            return False
        bias = reference.get(f"{name}.bias")
        if (bias is None) != (layer.bias is None):
            return False
        if bias is not None and not same_bits(layer.bias.data, bias):
            return False
    return True
