"""The lm_head's likeliest rows in int8, the rest int4: mixed precision where it pays.

A small model's lm_head (its tied embedding) is its largest layer, and int4 groups of 32
cost it more than any other: on SmolLM2 with every other layer kept on its grid
(:mod:`diffulex_edge.grid`), the int4 lm_head is most of what is left of the loss (held-out
paragraph 1.104x fp32's perplexity, against 1.035x with an int8 lm_head and 1.017x with a
float one). But a token's logit matters in proportion to how likely the token is, and a
few thousand tokens carry most of the probability. So the rows of the tokens the float
model finds likeliest on the calibration text (mean softmax probability) are int8, one
scale per row, and the others int4 as before; the two products' logits are put back in
vocabulary order. A twelfth of the rows, 4,096 of SmolLM2's 49,152, cost 1.2 MB more than all-int4 and take
the paragraph to about 1.08x (benchmarks/smollm2_quality.py).
"""

from __future__ import annotations

import torch
from torch import nn

from diffulex_edge.calibration import causal_windows

# The share of an int4 lm_head's rows that are int8 by default: 4,096 of SmolLM2's 49,152.
HEAD_INT8_SHARE = 1 / 12


@torch.no_grad()
def likely_rows(model: nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` vocabulary rows with the largest mean probability over causal forwards of
    ``ids`` (the model as it is), in increasing order."""
    total = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    for window in causal_windows(model, ids):
        probs = model(*window).float().softmax(-1)
        total += probs.reshape(-1, probs.shape[-1]).sum(0).double()
    return total.topk(n).indices.sort().values


def split_rows(vocab_size: int, share: float) -> int:
    """How many of ``vocab_size`` rows ``share`` makes int8: rounded, at least one if
    ``share`` > 0, and fewer than all."""
    if share <= 0:
        return 0
    return min(max(round(vocab_size * share), 1), vocab_size - 1)


class SplitHead(nn.Module):
    """``lm_head`` as two linear layers over the same input, ``int8`` for the rows
    ``rows`` and ``int4`` for the others, their outputs put back in vocabulary order."""

    def __init__(self, head: nn.Linear, rows: torch.Tensor) -> None:
        super().__init__()
        vocab = head.out_features
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[rows] = True
        rest = (~keep).nonzero().flatten()
        weight = head.weight.detach()
        self.int8 = _linear(weight[rows])
        self.int4 = _linear(weight[rest])
        order = torch.empty(vocab, dtype=torch.long)
        order[torch.cat([rows, rest])] = torch.arange(vocab)
        self.register_buffer("order", order)
        self.register_buffer("rest", rest, persistent=False)

    @property
    def out_features(self) -> int:
        return self.order.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.int8(x), self.int4(x)], -1).index_select(-1, self.order)


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


__all__ = ["HEAD_INT8_SHARE", "SplitHead", "likely_rows", "split_rows"]
