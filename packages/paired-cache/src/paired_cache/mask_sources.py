"""Mask sources: which neurons of a gated MLP to keep for a token (by name: registry).

A gated MLP computes down(act(gate x) * up x); neuron i matters for token x in
proportion to |act(gate_i . x) * (up_i . x)|. Every source returns an (N,) bool mask with
exactly k = round(fraction * N) rows set, so the cache's capacity is k.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from paired_cache._core import ffi, lib
from paired_cache.errors import PairedCacheError

Activation = Callable[[torch.Tensor], torch.Tensor]
DEFAULT_RANK = 128  # SmolLM2-135M: ~30% of the dense gate+up cost, recall ~0.65-0.7 at 50%


def active_rows(fraction: float, n_rows: int) -> int:
    """How many of n_rows rows a fraction picks.

    Args:
        fraction: a number in (0, 1].
        n_rows: N, the rows to pick from.

    Returns:
        k = round(fraction * N), at least 1 and at most N.

    Raises:
        PairedCacheError: fraction is not a number in (0, 1].
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise PairedCacheError(f"fraction must be a number in (0, 1], got {fraction!r}")
    if not 0.0 < fraction <= 1.0:
        raise PairedCacheError(f"fraction must be in (0, 1], got {fraction}")
    return max(1, min(n_rows, round(fraction * n_rows)))


def _top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: (N,) float -> (N,) bool with the k largest set."""
    mask = torch.zeros(scores.shape[0], dtype=torch.bool)
    mask[torch.topk(scores, k, sorted=False).indices] = True
    return mask


def rows_mask(idx: torch.Tensor, n_rows: int) -> torch.Tensor:
    """(m,) row ids -> (n_rows,) bool with them set."""
    mask = torch.zeros(n_rows, dtype=torch.bool)
    mask[idx.long()] = True
    return mask


def mask_rows(
    mask: torch.Tensor, gate: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N,) bool mask, (N,) gate or None -> its rows' ids ascending ((m,) int32) and the
    gate at them (None without one)."""
    idx = mask.nonzero().squeeze(1)
    return idx.to(torch.int32), None if gate is None else gate[idx]


def expected_abs(mean: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    """E|u| for u ~ Normal(mean, sd^2), elementwise: sd sqrt(2/pi) exp(-z^2/2) + mean
    erf(z/sqrt 2), z = mean/sd; |mean| where sd is 0."""
    sd = sd.clamp_min(torch.finfo(sd.dtype).tiny)
    z = mean / sd
    return sd * math.sqrt(2 / math.pi) * torch.exp(-0.5 * z * z) + mean * torch.erf(
        z * (1 / math.sqrt(2))
    )


def top_k_rows(
    gate: torch.Tensor,
    k: int,
    up_mean: torch.Tensor | None = None,
    up_sd: torch.Tensor | None = None,
    *,
    core: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k rows with the largest |gate| * E|up x| (|gate| without up_mean and up_sd), up
    x ~ Normal(up_mean, up_sd^2). What CATS and the gated trained predictor select with.

    Args:
        gate: (N,) act(gate x).
        k: how many rows, an int in [1, N].
        up_mean, up_sd: (N,) float32, or both None.
        core: with a float32 gate, score and select in one call of the C core
            (pc_select_gated_f32: ties to the lowest ids, NaN above +inf; the same rows,
            faster); otherwise, or with False, in torch (float32 scores, torch.topk), the
            reference the core is tested against.

    Returns:
        The rows' ids ascending, (k,) int32, and gate at them, (k,).

    Raises:
        PairedCacheError: a bad k, or only one of up_mean and up_sd.
    """
    n = gate.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise PairedCacheError(f"top_k_rows: k must be an int in [1, {n}], got {k!r}")
    if (up_mean is None) != (up_sd is None):
        raise PairedCacheError("top_k_rows: give both up_mean and up_sd, or neither")
    if not core or gate.dtype != torch.float32:
        scores = gate.abs().float()
        if up_mean is not None:
            scores = scores * expected_abs(up_mean, up_sd)
        idx = _top_k_mask(scores, k).nonzero().squeeze(1)
        return idx.to(torch.int32), gate[idx]
    gate = gate.contiguous()
    idx = torch.empty(k, dtype=torch.int32)
    at = torch.empty(k, dtype=torch.float32)
    mean = sd = ffi.NULL
    if up_mean is not None:
        up_mean, up_sd = up_mean.contiguous(), up_sd.contiguous()
        mean, sd = (ffi.cast("float *", t.data_ptr()) for t in (up_mean, up_sd))
    rc = lib.pc_select_gated_f32(
        ffi.cast("float *", gate.data_ptr()),
        mean,
        sd,
        n,
        k,
        ffi.cast("int32_t *", idx.data_ptr()),
        ffi.cast("float *", at.data_ptr()),
    )
    if rc != lib.PC_OK:
        raise PairedCacheError(f"selecting {k} of {n} rows failed in the C core (code {rc})")
    return idx, at


class MaskSource(ABC):
    """Chooses the active rows for one token.

    per_token: whether the mask depends on the token (False lets SparseMLP run a whole
    sequence through one update and one matmul). gives_gate: whether select_with_gate always
    returns act(gate x); SparseMLP's cache then keeps no gate rows among its active rows.
    """

    per_token: bool = True
    needs_calibration: bool = False
    gives_gate: bool = False
    # x (hidden,) -> gate x (N,): how a source that gives the gate computes it. None: its
    # own gate tensor; SparseMLP sets it to call its gate_proj child, so that a module put
    # in that child's place (another package's compressed linear) computes it.
    gate_product: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def gives_gate_for(cls, **options) -> bool:
        """gives_gate of the source build(..., **options) would make, known before the
        cache it reads from exists."""
        return cls.gives_gate

    def __init__(self, n_rows: int, fraction: float) -> None:
        self.n_rows = n_rows
        self.fraction = fraction
        self.k = active_rows(fraction, n_rows)

    def gate_x(self, x: torch.Tensor) -> torch.Tensor:
        """x: (hidden,) -> (N,) gate x, through gate_product when set, else self.gate."""
        if self.gate_product is not None:
            return self.gate_product(x)
        return self.gate @ x.to(self.gate.dtype)

    @abstractmethod
    def select(self, x: torch.Tensor) -> torch.Tensor:
        """x: (hidden,) float, one token's MLP input -> (N,) bool mask with k rows set."""

    def select_with_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """select(x), and act(gate x) (N,) in the gate's dtype when the source computed it
        for its scores (CATS, the gated trained predictor), else None: SparseMLP then
        reads only the up rows of the active set instead of computing the gate twice."""
        return self.select(x), None

    def select_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows select_with_gate(x) picks, as ids ascending ((m,) int32), and act(gate
        x) at them when the source computed it, else None: what SparseMLP's in-place path
        reads, without a mask in between where the source can skip it."""
        return mask_rows(*self.select_with_gate(x))

    @classmethod
    def build(
        cls,
        gate: torch.Tensor,
        up: torch.Tensor,
        act: Activation,
        fraction: float,
        calibration: torch.Tensor | None = None,
        **options,
    ) -> MaskSource:
        """The source for one MLP from its gate, up (N, hidden) and, when needs_calibration,
        calibration (T, hidden) inputs; what registry.make_source calls for a registered name."""
        return cls(gate, up, act, fraction, **options)


class OracleTopK(MaskSource):
    """The k rows with the largest |act(gate x) * up x|, computed densely: the quality
    ceiling of any predictor, and no saving in compute.

    gate, up: (N, hidden) float, the full weights (the cache's pools work).
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, act: Activation, fraction: float):
        super().__init__(gate.shape[0], fraction)
        self.gate, self.up, self.act = gate, up, act

    def select(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.gate.dtype)
        h = self.act(self.gate @ x) * (self.up @ x)  # (N,)
        return _top_k_mask(h.abs().float(), self.k)


class CatsMask(MaskSource):
    """CATS (Lee et al., 2024): the gate stays resident and is computed densely; the k rows
    with the largest |act(gate x)| are kept, then up and down run over them only.

    gate: (N, hidden) float (the cache's gate_pool: mapped from the pool file, its pages
    file-backed). threshold: keep rows with |act(gate x)| >= threshold instead of the top
    k, capped at k (the cache's capacity), at least one row.
    """

    gives_gate = True

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        act: Activation,
        fraction: float,
        threshold: float | None = None,
    ):
        super().__init__(gate.shape[0], fraction)
        if threshold is not None and (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not threshold >= 0
        ):
            raise PairedCacheError(f"threshold must be a number >= 0 or None, got {threshold!r}")
        self.gate, self.act, self.threshold = gate, act, threshold

    def select(self, x: torch.Tensor) -> torch.Tensor:
        return self.select_with_gate(x)[0]

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """x: (hidden,) -> (N,) act(gate x), the scores' source and what SparseMLP reuses."""
        return self.act(self.gate_x(x))

    def select_with_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = self.activation(x)  # (N,)
        return rows_mask(self._rows(gate)[0], self.n_rows), gate

    def select_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(self.activation(x))

    def _rows(self, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows (ids ascending, gate at them) this source keeps for act(gate x)."""
        if self.threshold is not None:
            above = (gate.abs().float() >= self.threshold).nonzero().squeeze(1)
            if 0 < above.numel() <= self.k:
                return above.to(torch.int32), gate[above]
            # more than the cache holds (the k strongest), or none (the strongest one)
            return top_k_rows(gate, self.k if above.numel() else 1)
        return top_k_rows(gate, self.k)


class LowRankPredictor(MaskSource):
    """Predicts |act(gate x) * up x| from rank-r approximations of gate and up fitted to
    calibration activations, and keeps the k largest.

    For each of gate and up (W: (N, hidden)), the outputs Y = X W^T on the calibration
    inputs X (T, hidden) give their top-r right singular vectors V_r (N, r); W x is then
    predicted as V_r (V_r^T W x): the best rank-r map on those inputs' output subspace.
    Cost per token: 2 r (hidden + N) multiply-adds instead of 2 hidden N. rank defaults
    to min(DEFAULT_RANK, T, hidden, N).
    """

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        act: Activation,
        fraction: float,
        calibration: torch.Tensor,
        rank: int | None = None,
    ) -> None:
        super().__init__(gate.shape[0], fraction)
        n, hidden = gate.shape
        if calibration.dim() != 2 or calibration.shape[1] != hidden:
            raise PairedCacheError(
                f"calibration has shape {tuple(calibration.shape)}, expected (T, {hidden})"
            )
        max_rank = min(calibration.shape[0], hidden, n)
        rank = min(DEFAULT_RANK, max_rank) if rank is None else rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
            raise PairedCacheError(
                f"rank must be an int in [1, min(T, hidden, N)={max_rank}], got {rank!r}"
            )
        self.act, self.rank = act, rank
        x = calibration.double()  # the SVD of a few hundred rows is cheap; fp64 keeps it clean
        self.gate_in, self.gate_out = self._fit(gate.double(), x, rank)
        self.up_in, self.up_out = self._fit(up.double(), x, rank)

    needs_calibration = True

    @classmethod
    def build(cls, gate, up, act, fraction, calibration=None, **options) -> LowRankPredictor:
        return cls(gate, up, act, fraction, _require(calibration, "lowrank"), **options)

    @staticmethod
    def _fit(w: torch.Tensor, x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """w: (N, hidden), x: (T, hidden) -> (hidden, r) and (r, N) float32 factors."""
        y = x @ w.T  # (T, N)
        v_r = torch.linalg.svd(y, full_matrices=False).Vh[:rank]  # (r, N)
        return (w.T @ v_r.T).float().contiguous(), v_r.float().contiguous()

    def select(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        g = (x @ self.gate_in) @ self.gate_out  # (N,)
        u = (x @ self.up_in) @ self.up_out
        return _top_k_mask((self.act(g) * u).abs(), self.k)


class FixedMask(MaskSource):
    """The same mask for every token (static pruning), e.g. from calibration statistics."""

    per_token = False
    needs_calibration = True

    def __init__(self, mask: torch.Tensor) -> None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
            raise PairedCacheError(f"mask must be a 1-D bool tensor, got {mask!r:.80}")
        count = int(mask.sum())
        if count == 0:
            raise PairedCacheError("mask selects no rows; a fixed mask needs at least one")
        super().__init__(mask.shape[0], count / mask.shape[0])
        self.k = count
        self.mask = mask.clone()

    @classmethod
    def from_calibration(
        cls,
        gate: torch.Tensor,
        up: torch.Tensor,
        act: Activation,
        fraction: float,
        calibration: torch.Tensor,
    ) -> FixedMask:
        """The k rows with the largest mean |act(gate x) * up x| over calibration (T, hidden)."""
        x = calibration.to(gate.dtype)
        h = act(x @ gate.T) * (x @ up.T)  # (T, N)
        return cls(_top_k_mask(h.abs().float().mean(0), active_rows(fraction, gate.shape[0])))

    @classmethod
    def build(cls, gate, up, act, fraction, calibration=None, **options) -> FixedMask:
        return cls.from_calibration(
            gate, up, act, fraction, _require(calibration, "fixed"), **options
        )

    def select(self, x: torch.Tensor) -> torch.Tensor:
        return self.mask


def _require(calibration: torch.Tensor | None, name: str) -> torch.Tensor:
    if calibration is None:
        raise PairedCacheError(f"mask source {name!r} needs calibration inputs (T, hidden)")
    return calibration


__all__ = [
    "CatsMask",
    "FixedMask",
    "LowRankPredictor",
    "MaskSource",
    "OracleTopK",
    "active_rows",
    "expected_abs",
    "mask_rows",
    "rows_mask",
    "top_k_rows",
]
