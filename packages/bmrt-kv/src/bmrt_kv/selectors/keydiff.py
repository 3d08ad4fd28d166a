"""KeyDiff: keep the keys least similar to a mean key (the pool's, or the whole stream's);
with a known question, a share of the slots goes to what the question attends to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.errors import BMRTError, check_choice, check_fraction
from bmrt_kv.selectors.attention import MAX_KERNEL, attention_mass, max_pool_over_time
from bmrt_kv.selectors.base import Pool, Selector, top_k


@dataclass(eq=False)
class KeyDiffSelector(Selector):
    """Scores a candidate by minus the cosine similarity of its key to its head's anchor, a
    mean key (KeyDiff, Park et al. 2025).

    Repetitive context (boilerplate, filler, logs) yields keys close to the mean; rare
    content stands out and is kept. Key difference ignores the queries and is cheap: one
    mean and one cosine per token.

    ``anchor`` chooses the mean. ``"pool"`` (the paper's block-wise eviction) averages the
    candidates of this step: what the layer kept plus the new block. What it kept are the
    keys that stood out before, so at a small budget they pull the mean toward themselves.
    ``"stream"`` averages the unit-normalised keys of every token the layer has seen,
    kept or evicted (a running sum, ``hd`` floats per head), which is the mean kvpress's
    KeyDiffPress takes over the whole prefilled context.

    Under query-aware scoring (the pool carries the question's queries), ``question_share``
    of the slots first go to the candidates the question attends to most, max-pooled over
    ``kernel`` neighbours (SnapKV's scoring with the question as its observation window);
    key difference fills the rest. Under agnostic scoring, key difference fills them all.

    Paper: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
    LLM Inference in Resource-Constrained Environments", https://arxiv.org/abs/2504.15364

    Args:
        question_share: the share of the slots the question picks under query-aware
            scoring, in [0, 1] (0: key difference alone, whatever the scoring).
        kernel: pooling kernel of the question's attention, odd, in [1, 1023].
        anchor: ``"pool"`` or ``"stream"``, the mean key a candidate is compared with.
    """

    name: ClassVar[str] = "keydiff"
    question_share: float = 0.5
    kernel: int = 7
    anchor: str = "pool"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.question_share = check_fraction(
            f"selector {self.name!r} option 'question_share'", self.question_share, False
        )
        self.kernel = self.option("kernel", self.kernel, 1, MAX_KERNEL, odd=True)
        self.anchor = check_choice(
            f"selector {self.name!r} option 'anchor'", self.anchor, ("pool", "stream")
        )

    @property
    def needs_key_sum(self) -> bool:
        return self.anchor == "stream"

    def score(self, pool: Pool) -> torch.Tensor:
        """Key difference alone (:meth:`select` adds the question's picks)."""
        keys = torch.nn.functional.normalize(pool.keys.to(torch.float32), dim=-1)  # (b,h,P,hd)
        if self.anchor == "stream":
            if pool.key_sum is None:
                raise BMRTError(
                    "selector 'keydiff' with anchor 'stream' needs Pool.key_sum (the layer "
                    "keeps it when the selector's needs_key_sum is True)"
                )
            mean = pool.key_sum.to(torch.float32).unsqueeze(-2)  # (b, h, 1, hd)
        else:
            weight = pool.candidates.to(keys.dtype)  # (b, h, P)
            # The candidates' mean key, as a weighted sum: (b, h, 1, hd) without a weighted
            # copy of every key.
            mean = torch.matmul(weight.unsqueeze(-2), keys)
            mean = mean / weight.sum(-1).clamp(min=1).view(*weight.shape[:2], 1, 1)
        mean = torch.nn.functional.normalize(mean, dim=-1, eps=1e-12)
        cosine = torch.matmul(keys, mean.transpose(-1, -2)).squeeze(-1)  # (b, h, P)
        return (-cosine).to(torch.float64)

    def select(
        self, pool: Pool, k: int, shared: bool = False, exclude: torch.Tensor | None = None
    ) -> torch.Tensor:
        k_question = round(self.question_share * k) if pool.n_question else 0
        if k_question == 0:
            return super().select(pool, k, shared, exclude)
        eligible = pool.candidates if exclude is None else pool.candidates & ~exclude
        mass = attention_mass(pool, last_queries=pool.n_question)  # (b, h, P)
        pooled = max_pool_over_time(mass, self.kernel).to(torch.float64)
        first = top_k(pooled, eligible, k_question, shared)
        taken = torch.zeros_like(eligible)
        taken.scatter_(-1, first, True)
        if exclude is not None:
            taken |= exclude
        second = super().select(pool, k - k_question, shared, taken)
        return torch.cat([first, second], dim=-1)
