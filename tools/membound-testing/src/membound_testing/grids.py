"""Weights as a GGUF dequantizes them, for tiny models: every block of 32 inputs of a row
rounded through Q4_1 or Q8_0 the way llama.cpp quantizes and gguf dequantizes (SmolLM2's
float copy is such a model: its grid is what paired-cache's grid pools store)."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

BLOCK = 32


def q4_1(w: torch.Tensor) -> torch.Tensor:
    """w (rows, cols) float32, cols a multiple of 32, through a Q4_1 round trip: per block
    d = (max - min) / 15 and q = round((x - min) / d) in 0..15 (llama.cpp), d and min
    stored as float16, dequantized as d * q + m in float32."""
    b = w.reshape(w.shape[0], -1, BLOCK)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.round((b - lo) / torch.where(d > 0, d, 1)).clamp(0, 15).to(torch.uint8).float()
    return (d.half().float() * q + lo.half().float()).reshape(w.shape)


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """w through a Q8_0 round trip: d = amax / 127, q = round(x / d) an int8 (so a value
    rounded to 0 gives +0.0, as a GGUF's int8 does), d stored as float16."""
    b = w.reshape(w.shape[0], -1, BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b / torch.where(d > 0, d, 1)).clamp(-128, 127).to(torch.int8).float()
    return (d.half().float() * q).reshape(w.shape)


def on_gguf_grid(model: nn.Module, globs=("*.mlp.*",), q8_globs=("*down_proj*",)) -> nn.Module:
    """model with each 2-D weight whose name matches ``globs`` on a GGUF grid, in place:
    Q8_0 where it also matches ``q8_globs``, Q4_1 otherwise. Returns model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 2 or not any(fnmatch.fnmatch(name, g) for g in globs):
                continue
            q8 = any(fnmatch.fnmatch(name, g) for g in q8_globs)
            p.copy_(q8_0(p) if q8 else q4_1(p))
    return model


__all__ = ["BLOCK", "on_gguf_grid", "q4_1", "q8_0"]
