"""SimHash with L tables of K bits, computed with one matmul on the tensors' device."""

from __future__ import annotations

import torch

#: Bucket ids are computed in float32 (exact up to 2**24); 16 bits keep the histograms small.
MAX_BITS = 16


class SimHash:
    """Random-hyperplane hashing: bit j of x is ``x . r_j > 0``.

    The hyperplanes come from a CPU ``torch.Generator`` seeded with ``seed``, so the
    same seed gives the same hashes on every device and run.

    Args:
        tables: L >= 1 hash tables.
        bits: K bits per table, 1..16 (a table has 2**K buckets).
        seed: generator seed.

    The selectors that own one check these before building it.
    """

    def __init__(self, tables: int, bits: int, seed: int) -> None:
        self.tables = tables
        self.bits = bits
        self.seed = seed
        self._planes: dict[tuple, torch.Tensor] = {}

    def planes(self, head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(hd, L*K) hyperplanes, drawn once per (head_dim, device, dtype)."""
        key = (head_dim, device, dtype)
        if key not in self._planes:
            gen = torch.Generator(device="cpu").manual_seed(self.seed)
            planes = torch.randn(head_dim, self.tables * self.bits, generator=gen)
            self._planes[key] = planes.to(device=device, dtype=dtype)
        return self._planes[key]

    def signs(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., N, hd) float -> (..., N, L*K) float32 of +-1 (+1 where the projection
        is positive)."""
        proj = torch.matmul(x, self.planes(x.shape[-1], x.device, x.dtype)).float()
        return proj.gt_(0).mul_(2).sub_(1)  # in place: no second (N, L*K) matrix

    def codes(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., N, hd) float -> (..., N, L) int64 bucket ids."""
        return self.codes_from_signs(self.signs(x))

    def codes_from_signs(self, signs: torch.Tensor) -> torch.Tensor:
        """:meth:`signs` (..., N, L*K) -> (..., N, L) int64 bucket ids."""
        # Bits to bucket ids with one matmul against a block-diagonal matrix of powers of
        # two (exact in float32 up to 2**24); cheaper than int64 shifts and sums on CPU.
        # With bit = (sign + 1) / 2 the ids come straight from the signs.
        weights = self.code_weights(signs.device)  # (L*K, L)
        return torch.matmul(signs, weights).add_(weights.sum(0)).div_(2).to(torch.int64)

    def code_weights(self, device: torch.device) -> torch.Tensor:
        """(L*K, L) float32: block-diagonal powers of two, bits -> bucket ids."""
        key = ("weights", device)
        if key not in self._planes:
            powers = 2.0 ** torch.arange(self.bits, dtype=torch.float32)
            weights = torch.block_diag(*[powers.view(-1, 1)] * self.tables)  # (L*K, L)
            self._planes[key] = weights.to(device)
        return self._planes[key]


def collision_counts(
    query_codes: torch.Tensor,
    key_codes: torch.Tensor,
    bits: int,
    query_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many (query, table) pairs share each key's bucket.

    Args:
        query_codes: (b, h, Q, L) int64.
        key_codes: (b, h, P, L) int64.
        bits: K, so buckets are [0, 2**K).
        query_weights: (Q,) float, each query's weight (None: each counts 1).

    Returns:
        (b, h, P) = sum over tables l of #{q : code_l(q) == code_l(key)} (int64), or of
        the weights of those queries (float64) when ``query_weights`` is given.
    """
    b, h, _, n_tables = query_codes.shape
    buckets = 2**bits
    # One histogram per (b, h, table): offset each row's codes into its own bucket range.
    rows = torch.arange(b * h * n_tables, device=query_codes.device).view(b, h, 1, n_tables)
    flat = (query_codes + rows * buckets).reshape(-1)
    weights = None
    if query_weights is not None:
        weights = query_weights.to(torch.float64).view(1, 1, -1, 1).expand(query_codes.shape)
        weights = weights.reshape(-1)
    hist = torch.bincount(flat, weights=weights, minlength=b * h * n_tables * buckets)
    hist = hist.view(b, h, n_tables, buckets)
    per_table = hist.gather(-1, key_codes.permute(0, 1, 3, 2))  # (b, h, L, P)
    return per_table.sum(dim=-2)
