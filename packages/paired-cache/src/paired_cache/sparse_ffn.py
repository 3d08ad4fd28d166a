"""SparseFFN: a non-gated MLP (GPT-NeoX, Phi-2, OPT) computed over its cached active rows.

A non-gated MLP computes fc2(act(fc1 x + b1)) + b2; neuron i is row i of fc1 (and b1[i])
and column i of fc2, the row-column bundle LLM in a Flash loads. The paired cache keeps
each neuron's fc1 row and fc2 column side by side in one pool row (as up and down_T).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paired_cache.cache import PairedCache
from paired_cache.config import PairedCacheConfig
from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import Activation, CatsMask, active_rows
from paired_cache.sparse_base import CachedMLP, check_prefill

# The mask sources a non-gated MLP takes: the others score act(gate x) * up x.
FFN_SOURCES = ("cats",)


class FFNCats(CatsMask):
    """CATS on a non-gated MLP: the k rows with the largest |act(fc1 x + b1)|. fc1 is
    computed densely, as CATS computes the gate: its values are the MLP's hidden state, so
    only the fc2 columns of the rows left out are skipped.

    fc1: (N, hidden) float (the cache's up_pool); bias: (N,) or None; threshold as CatsMask.
    """

    def __init__(
        self,
        fc1: torch.Tensor,
        bias: torch.Tensor | None,
        act: Activation,
        fraction: float,
        threshold: float | None = None,
    ) -> None:
        super().__init__(fc1, fc1, act, fraction, threshold)
        self.bias = bias

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """x: (hidden,) -> (N,) act(fc1 x + b1)."""
        return self.act(F.linear(x.to(self.gate.dtype), self.gate, self.bias))


class SparseFFN(CachedMLP):
    """fc2(act(fc1 x + b1)) + b2 over the rows a mask source picks for each token.

    forward: x (..., hidden) float -> (..., hidden). With a full mask it equals the dense
    MLP up to float rounding (one matrix-vector product per token where the dense MLP
    runs one matrix product for the prompt).
    """

    def __init__(
        self,
        cache: PairedCache,
        act: Activation,
        source: FFNCats,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        prefill: str = "sparse",
    ) -> None:
        """
        Args:
            cache: fc1 as up (N, hidden) and fc2 as down (hidden, N), no gate.
            act: The activation between them.
            source: Picks each token's rows (``source.k`` of the cache's N).
            up_bias: (N,) fc1's bias, or None.
            down_bias: (hidden,) fc2's bias, or None.
            prefill: As SparseMLP's: "sparse" or "dense".

        Raises:
            PairedCacheError: A cache with a gate, or one that does not hold the source's rows.
        """
        super().__init__()
        check_prefill(prefill)
        if cache.gate_cols or source.n_rows != cache.n_rows or source.k > cache.capacity:
            raise PairedCacheError(
                f"SparseFFN needs a gate-less cache holding the source's {source.k} of "
                f"{source.n_rows} rows; got gate_cols={cache.gate_cols}, N={cache.n_rows}, "
                f"capacity={cache.capacity}"
            )
        self.cache, self.act_fn, self.source, self.prefill = cache, act, source, prefill
        self.up_bias, self.down_bias = up_bias, down_bias
        self.tokens = 0
        self.pool_rows_read = 0

    @classmethod
    def from_linears(
        cls,
        fc1: nn.Linear,
        fc2: nn.Linear,
        act: Activation,
        source: str,
        fraction: float,
        config: PairedCacheConfig | None = None,
        prefill: str = "sparse",
        **options,
    ) -> SparseFFN:
        """Wrap the two projections of a non-gated MLP.

        Args:
            fc1: the (N, hidden) up projection (a bias is kept, as fc2's).
            fc2: the (hidden, N) down projection.
            act: the MLP's activation.
            source: one of FFN_SOURCES.
            fraction: the share of the rows each token reads, in (0, 1].
            config: the cache's PairedCacheConfig (None: its defaults).
            prefill: how a forward of several tokens runs, see SparseMLP.prefill.
            **options: the source's options (CATS: threshold).

        Returns:
            The SparseFFN.
        """
        if source not in FFN_SOURCES:
            raise PairedCacheError(
                f"mask source {source!r} needs a gated MLP; a non-gated one takes {FFN_SOURCES}"
            )
        check_prefill(prefill)
        with torch.no_grad():
            up, down = fc1.weight.detach().contiguous(), fc2.weight.detach().contiguous()
            n = up.shape[0]
            if tuple(down.shape) != (up.shape[1], n):
                raise PairedCacheError(
                    f"fc2 has shape {tuple(down.shape)}, expected ({up.shape[1]}, {n}) for an "
                    f"fc1 of shape {tuple(up.shape)}"
                )
            cache = PairedCache(up, down, capacity=active_rows(fraction, n), config=config)
            up_bias, down_bias = (
                None if lin.bias is None else lin.bias.detach().to(up.dtype).clone()
                for lin in (fc1, fc2)
            )
            src = FFNCats(cache.up_pool, up_bias, act, fraction, **options)
        return cls(cache, act, src, up_bias, down_bias, prefill)

    @property
    def pool_bytes_read(self) -> int:
        """Bytes copied from the neuron pool into the active rows since construction."""
        return self.pool_rows_read * self.cache.active_row_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN over each token's predicted-active rows (a multi-token input with
        ``prefill="dense"``: over every row).

        Args:
            x: (..., hidden) the FFN's input.

        Returns:
            (..., hidden) its output, in ``x``'s dtype.
        """
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(self.cache.dtype)  # (T, hidden)
        if flat.shape[0] > 1 and self.prefill == "dense":
            h = self.act_fn(F.linear(flat, self.cache.up_pool, self.up_bias))  # (T, N)
            out = F.linear(h, self.cache.down_pool_T.t(), self.down_bias)
        else:
            out = torch.empty_like(flat)
            # One mask per token, as in decoding: a prompt runs token by token here.
            for t in range(flat.shape[0]):
                mask, h = self.source.select_with_gate(flat[t])  # h: (N,) act(fc1 x + b1)
                info = self.cache.update(mask)
                self.pool_rows_read += info.rows_copied if info.rebuilt else info.added
                m = self.cache.num_active
                # down(): (hidden, m), the fc2 columns of the active rows
                out[t] = F.linear(h[self.cache._indices[:m]], self.cache.down(), self.down_bias)
        self.tokens += flat.shape[0]
        return out.view(shape).to(x.dtype)
