"""Hybrid selection: a primary selector fills a ratio of the slots, a secondary the rest."""

from __future__ import annotations

import torch

from bmrt_kv.selectors.base import Pool, Selector


class HybridSelector(Selector):
    """Primary picks round(ratio * k) tokens; secondary picks the rest from what remains.

    Args:
        primary: name of a registered selector (not ``hybrid``).
        secondary: name of a registered selector (not ``hybrid``).
        ratio: R in [0, 1].
        primary_options / secondary_options: their constructor keywords.
    """

    def __init__(
        self,
        seed: int = 0,
        primary: str = "exact",
        secondary: str = "lsh",
        ratio: float = 0.5,
        primary_options: dict | None = None,
        secondary_options: dict | None = None,
    ) -> None:
        from bmrt_kv.selectors import make_selector

        super().__init__(seed)
        if not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be a number in [0, 1], got {ratio!r}")
        for name, value in (("primary", primary), ("secondary", secondary)):
            if value == "hybrid":
                raise ValueError(f"{name} must not be 'hybrid' itself")
        self.primary = make_selector(primary, primary_options or {}, seed)
        self.secondary = make_selector(secondary, secondary_options or {}, seed + 1)
        self.ratio = float(ratio)
        self.stateful = self.primary.stateful or self.secondary.stateful

    def score(self, pool: Pool) -> torch.Tensor:
        """The primary's scores (used only where a caller wants a single ranking)."""
        return self.primary.score(pool)

    def select(
        self, pool: Pool, k: int, shared: bool = False, exclude: torch.Tensor | None = None
    ) -> torch.Tensor:
        k_primary = round(self.ratio * k)
        first = self.primary.select(pool, k_primary, shared, exclude)
        taken = torch.zeros_like(pool.candidates)
        taken.scatter_(-1, first, True)
        if exclude is not None:
            taken |= exclude
        second = self.secondary.select(pool, k - k_primary, shared, taken)
        return torch.cat([first, second], dim=-1)
