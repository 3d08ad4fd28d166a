"""Token sampling as in the SDAR reference: temperature, top-k, top-p, or greedy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingConfig:
    """``temperature == 0`` is greedy (argmax); otherwise sampling draws from ``generator``.

    The returned confidence is always the probability of the chosen token under the
    (filtered, tempered) distribution, which remasking ranks by.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: (N, V) float -> the same with filtered-out entries at -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -torch.inf)
    return logits


def sample_tokens(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (..., V) float -> (tokens (...) int64, confidence (...) float32)."""
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if config.greedy:
        probs = torch.softmax(flat, dim=-1)
        tokens = probs.argmax(dim=-1, keepdim=True)
    else:
        flat = filter_logits(flat / config.temperature, config.top_k, config.top_p)
        probs = torch.softmax(flat, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator)
    conf = probs.gather(-1, tokens)
    return tokens.view(shape), conf.view(shape)
