"""An int8 embedding table that any ExecuTorch runtime runs.

A small model's embedding is a large share of its program: SmolLM2-135M's is 28 M of its
135 M weights, 108 MiB in float32. ExecuTorch has quantized embedding kernels
(``quantized_decomposed::embedding_byte``), but they live in a separate kernel library that
a device's runtime must link. :class:`Int8Embedding` needs none: its forward is two ordinary
embedding lookups (the int8 rows and their scales) and a multiply, which the portable
kernels of every runtime hold, so a program still loads wherever an fp32 one does.

Each row is symmetric int8 with its own float32 scale (max |w| / 127): the lookup returns
exactly ``int8 row * scale``, in eager PyTorch and in the program alike.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Int8Embedding(nn.Module):
    """An embedding table held as int8 rows, one float scale per row.

    Args:
        weight: the float (vocab, hidden) table to quantize.

    Attributes:
        weight: (vocab, hidden) int8 codes in [-127, 127].
        scales: (vocab, 1) float scales, in ``weight``'s original dtype.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        weight = weight.detach()
        scales = weight.abs().amax(1, keepdim=True) / 127
        scales = scales.clamp(min=torch.finfo(weight.dtype).tiny)
        codes = torch.clamp(torch.round(weight / scales), -127, 127).to(torch.int8)
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.weight.shape[1]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``input_ids``, dequantized.

        Args:
            input_ids: token ids, any shape.

        Returns:
            ``input_ids.shape + (hidden,)`` in the scales' dtype.
        """
        rows = F.embedding(input_ids, self.weight)
        return rows.to(self.scales.dtype) * F.embedding(input_ids, self.scales)

    def dequantize(self) -> torch.Tensor:
        """The whole table as floats ((vocab, hidden), what each lookup returns)."""
        return self.weight.to(self.scales.dtype) * self.scales


def quantize_embedding(model: nn.Module) -> nn.Module:
    """Replace ``model.embed_tokens`` by an :class:`Int8Embedding` of its table, in place.
    A tied ``lm_head`` keeps the float weights it holds (quantize it separately).

    Args:
        model: an :class:`~diffulex_edge.model.SDARModel`.

    Returns:
        ``model``.
    """
    model.embed_tokens = Int8Embedding(model.embed_tokens.weight)
    return model


__all__ = ["Int8Embedding", "quantize_embedding"]
