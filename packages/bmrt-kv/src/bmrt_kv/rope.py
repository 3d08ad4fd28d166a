"""Rotary position embedding helpers: rotate queries for scoring, re-rotate cached keys."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The (-x2, x1) half swap used by Llama-family RoPE."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, T, H, hd); cos, sin: (b, T, rd) as the model's rotary embedding returns them.
    With partial rotary (rd < hd, as Phi-3 may set) only the first rd features turn."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    rd = cos.shape[-1]
    turned = x[..., :rd] * cos + rotate_half(x[..., :rd]) * sin
    return turned if rd == x.shape[-1] else torch.cat([turned, x[..., rd:]], dim=-1)


def rerotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move rotated keys by ``delta`` positions.

    RoPE rotations compose, so a key rotated at position p becomes the key at p + delta
    after one more rotation by delta (no un-rotation, no attention scaling: that factor
    was applied once already).

    Args:
        keys: (b, h, S, hd) float.
        delta: (b, h, S) int64, positions to move each key by.
        inv_freq: (rd / 2,) float, the model's rotary inverse frequencies (rd < hd under
            partial rotary: only the first rd features turn).

    Returns:
        (b, h, S, hd) keys, same dtype.
    """
    rd = 2 * inv_freq.shape[-1]
    # float64 angles: positions reach tens of thousands and float32 would lose phase.
    angle = delta.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)  # (b,h,S,rd/2)
    emb = torch.cat((angle, angle), dim=-1)
    cos, sin = emb.cos().to(keys.dtype), emb.sin().to(keys.dtype)
    turned = keys[..., :rd] * cos + rotate_half(keys[..., :rd]) * sin
    return turned if rd == keys.shape[-1] else torch.cat([turned, keys[..., rd:]], dim=-1)
