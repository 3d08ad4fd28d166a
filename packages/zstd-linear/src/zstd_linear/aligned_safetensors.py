"""A safetensors file whose every tensor starts 64 bytes into a cache line, so that a
tensor viewed from its mapping sits where a fresh allocation would.

The CPU GEMV kernel's rounding depends on the weight's address modulo 64: a plain
Linear weight (a tied ``lm_head`` left plain) viewed at safetensors' 8-byte offsets gives
one-row logits that differ in the last bits from the saved model's. safetensors allows
no gap between tensors, so the gaps are ``uint8`` tensors named ``PAD_PREFIX<n>``, which
readers skip; the header is padded with spaces (as safetensors pads it to 8 bytes).
"""

from __future__ import annotations

import json
import os
import struct

import torch

from zstd_linear.errors import ZstdLinearError

ALIGN = 64
PAD_PREFIX = "__zstd_linear_pad__"
# safetensors' dtype names; the companion reader accepts these.
DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def write_aligned(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write ``tensors`` (CPU, contiguous) and ``metadata`` to ``path`` as safetensors,
    every tensor's data at a file offset that is a multiple of ``ALIGN``.

    Raises:
        ZstdLinearError: a tensor's dtype is not one of ``DTYPES``, or a name starts with
            ``PAD_PREFIX``.
    """
    for name, tensor in tensors.items():
        if tensor.dtype not in _NAMES:
            raise ZstdLinearError(
                f"tensor {name!r} has dtype {tensor.dtype}; supported: {sorted(DTYPES)}"
            )
        if name.startswith(PAD_PREFIX):
            raise ZstdLinearError(f"tensor name {name!r} is reserved for padding")
    header: dict[str, dict] = {"__metadata__": metadata}
    parts: list[torch.Tensor] = []  # (nbytes,) uint8 each, in file order
    offset = 0
    for name, tensor in sorted(tensors.items()):
        gap = -offset % ALIGN
        if gap:
            pad = f"{PAD_PREFIX}{len(parts)}"
            header[pad] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            parts.append(torch.zeros(gap, dtype=torch.uint8))
            offset += gap
        data = tensor.reshape(-1).view(torch.uint8)  # (nbytes,)
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.numel()],
        }
        parts.append(data)
        offset += data.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in parts:
            f.write(data.numpy().data)
