"""MagicPIG baseline: deterministic LSH sampling probabilities from Hamming distances."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.selectors.base import Pool, Selector
from bmrt_kv.selectors.simhash import MAX_BITS, SimHash

#: Per-(query, key) collision counts are uint8; more tables would wrap them.
MAX_TABLES = 255
#: Queries scored at once.
QUERY_CHUNK = 16


@dataclass(eq=False)
class MagicPIGSelector(Selector):
    """Score = sum over queries of the probability that MagicPIG's LSH sampler retrieves
    the candidate: with p = 1 - D(q, k) / (L*K) (D the Hamming distance),
    u = 1 - (1 - p^K)^L - L p^K (1 - p^K)^(L-1), the chance of colliding in >= 2 tables.

    Only candidates that do collide with some query in >= 2 tables are valid; when fewer
    than needed are valid the rest is filled with the most recent tokens.

    Paper: Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation",
    https://arxiv.org/abs/2410.16179

    Args:
        tables: L hash tables, in [1, 255] (collisions are counted in uint8).
        bits: K bits per table, in [1, 16].
    """

    name: ClassVar[str] = "magicpig"
    tables: int = 16
    bits: int = 6

    def __post_init__(self) -> None:
        super().__post_init__()
        self.tables = self.option("tables", self.tables, 1, MAX_TABLES)
        self.bits = self.option("bits", self.bits, 1, MAX_BITS)
        self.hash = SimHash(self.tables, self.bits, self.seed)

    def score(self, pool: Pool) -> torch.Tensor:
        n_tables, n_bits = self.hash.tables, self.hash.bits
        keys = pool.keys
        planes = self.hash.planes(keys.shape[-1], keys.device, keys.dtype)  # (hd, L*K)
        # The keys' signs made directly in the (L*K, P) layout every chunk's matmul wants,
        # in place: one (b, h, L*K, P) matrix, never a second copy.
        k_signs_t = torch.matmul(planes.t(), keys.transpose(-1, -2)).float()
        k_signs_t.gt_(0).mul_(2).sub_(1)  # (b, h, L*K, P) of +-1
        code_weights = self.hash.code_weights(keys.device)  # (L*K, L)
        k_codes_t = torch.matmul(code_weights.t(), k_signs_t)  # (b, h, L, P), as codes_from_signs
        k_codes_t = k_codes_t.add_(code_weights.sum(0).view(-1, 1)).div_(2).to(torch.int64)
        total = n_tables * n_bits
        n_queries = pool.queries.shape[-2]
        relevance = torch.zeros(pool.keys.shape[:-1], dtype=torch.float32, device=keys.device)
        valid = torch.zeros(pool.keys.shape[:-1], dtype=torch.bool, device=keys.device)
        # QUERY_CHUNK queries at a time: the (b, h, chunk, P) temporaries stay a fraction of
        # the pool's keys instead of (b, h, Q, P) matrices of every query.
        for start in range(0, n_queries, QUERY_CHUNK):
            stop = min(start + QUERY_CHUNK, n_queries)
            q_signs = self.hash.signs(pool.queries[:, :, start:stop])  # (b, h, C, L*K)
            q_codes = self.hash.codes_from_signs(q_signs)  # (b, h, C, L)
            matches = torch.matmul(q_signs, k_signs_t)  # (b, h, C, P)
            # In place where it can be, so a chunk holds at most four (b, h, C, P) matrices.
            pk = matches.add_(total).div_(2 * total).pow_(n_bits)  # p^K, p = 1 - hamming/total
            miss = 1 - pk
            tail = miss.pow(n_tables - 1)
            two_or_more = tail.mul(pk).mul_(n_tables)  # L p^K (1 - p^K)^(L-1)
            del pk
            u = tail.mul_(miss).neg_().add_(1).sub_(two_or_more)  # 1 - (1 - p^K)^L - ...
            del miss, two_or_more
            if pool.query_weights is None:
                relevance += u.sum(dim=-2)
            else:
                weights = pool.query_weights[start:stop].to(u.dtype)
                relevance += torch.einsum("bhqp,q->bhp", u, weights)
            del u
            collisions = torch.zeros(
                (*q_codes.shape[:-1], k_codes_t.shape[-1]), dtype=torch.uint8, device=keys.device
            )
            for table in range(n_tables):
                collisions += q_codes[..., table, None] == k_codes_t[..., table, None, :]
            valid |= (collisions >= 2).any(dim=-2)  # (b, h, P)

        positions = pool.positions.double()
        recency = positions / (positions.max() + 1) - 1.0  # in [-1, 0): below every valid
        return torch.where(valid, relevance.double(), recency)
