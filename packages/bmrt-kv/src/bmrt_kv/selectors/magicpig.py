"""MagicPIG baseline: deterministic LSH sampling probabilities from Hamming distances."""

from __future__ import annotations

import torch

from bmrt_kv.selectors.base import Pool, Selector
from bmrt_kv.selectors.simhash import MAX_BITS, SimHash

#: Per-(query, key) collision counts are uint8; more tables would wrap them.
MAX_TABLES = 255


class MagicPIGSelector(Selector):
    """Score = sum over queries of the probability that MagicPIG's LSH sampler retrieves
    the candidate: with p = 1 - D(q, k) / (L*K) (D the Hamming distance),
    u = 1 - (1 - p^K)^L - L p^K (1 - p^K)^(L-1), the chance of colliding in >= 2 tables.

    Only candidates that do collide with some query in >= 2 tables are valid; when fewer
    than needed are valid the rest is filled with the most recent tokens.

    Args:
        tables: L hash tables, in [1, 255] (collisions are counted in uint8).
        bits: K bits per table, in [1, 16].
    """

    name = "magicpig"

    def __init__(self, seed: int = 0, tables: int = 16, bits: int = 6) -> None:
        super().__init__(seed)
        tables = self.option("tables", tables, 1, MAX_TABLES)
        self.hash = SimHash(tables, self.option("bits", bits, 1, MAX_BITS), seed)

    def score(self, pool: Pool) -> torch.Tensor:
        n_tables, n_bits = self.hash.tables, self.hash.bits
        q_signs = self.hash.signs(pool.queries).float()  # (b, h, Q, L*K)
        k_signs = self.hash.signs(pool.keys).float()  # (b, h, P, L*K)
        total = n_tables * n_bits
        hamming = (total - torch.matmul(q_signs, k_signs.transpose(-1, -2))) / 2  # (b,h,Q,P)
        p = 1.0 - hamming / total
        pk = p**n_bits
        u = 1 - (1 - pk) ** n_tables - n_tables * pk * (1 - pk) ** (n_tables - 1)
        if pool.query_weights is None:
            relevance = u.sum(dim=-2)  # (b, h, P)
        else:
            relevance = torch.einsum("bhqp,q->bhp", u, pool.query_weights.to(u.dtype))

        q_codes = self.hash.codes(q_signs)  # (b, h, Q, L)
        k_codes = self.hash.codes(k_signs)  # (b, h, P, L)
        collisions = torch.zeros(hamming.shape, dtype=torch.uint8, device=hamming.device)
        for table in range(n_tables):
            # One table at a time keeps the (Q, P) comparison the largest live tensor.
            collisions += q_codes[..., table, None] == k_codes[..., None, :, table]
        valid = (collisions >= 2).any(dim=-2)  # (b, h, P)

        positions = pool.positions.double()
        recency = positions / (positions.max() + 1) - 1.0  # in [-1, 0): below every valid
        return torch.where(valid, relevance.double(), recency)
