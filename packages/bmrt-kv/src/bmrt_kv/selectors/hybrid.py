"""Hybrid selection: a primary selector fills a ratio of the slots, a secondary the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from bmrt_kv.errors import BMRTError, check_choice, check_fraction
from bmrt_kv.selectors.base import Pool, Selector
from bmrt_kv.selectors.registry import SELECTORS, make_selector


@dataclass(eq=False)
class HybridSelector(Selector):
    """Primary picks round(ratio * k) tokens; secondary picks the rest from what remains.

    Args:
        primary: name of a registered selector (not ``hybrid``).
        secondary: name of a registered selector (not ``hybrid``).
        ratio: R in [0, 1].
        primary_options / secondary_options: their constructor keywords (a dict or None).
    """

    name: ClassVar[str] = "hybrid"
    primary: str = "exact"
    secondary: str = "lsh"
    ratio: float = 0.5
    primary_options: dict | None = None
    secondary_options: dict | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ratio = check_fraction(f"selector {self.name!r} option 'ratio'", self.ratio, False)
        stages = []
        for stage, name, options, stage_seed in (
            ("primary", self.primary, self.primary_options, self.seed),
            ("secondary", self.secondary, self.secondary_options, self.seed + 1),
        ):
            where = f"selector {self.name!r} option {stage!r}"
            check_choice(where, name, set(SELECTORS) - {"hybrid"})
            if options is not None and not isinstance(options, dict):
                raise BMRTError(
                    f"selector {self.name!r} option '{stage}_options' must be a dict or None, "
                    f"got {options!r}"
                )
            try:
                stages.append(make_selector(name, options, stage_seed))
            except BMRTError as err:
                raise BMRTError(f"selector {self.name!r} option '{stage}_options': {err}") from err
        #: The two built stages (``primary`` / ``secondary`` stay the names given).
        self.stages: tuple[Selector, Selector] = (stages[0], stages[1])
        self.stateful = stages[0].stateful or stages[1].stateful

    @property
    def needs_key_sum(self) -> bool:
        return self.stages[0].needs_key_sum or self.stages[1].needs_key_sum

    def score(self, pool: Pool) -> torch.Tensor:
        """The primary's scores (used only where a caller wants a single ranking)."""
        return self.stages[0].score(pool)

    def select(
        self, pool: Pool, k: int, shared: bool = False, exclude: torch.Tensor | None = None
    ) -> torch.Tensor:
        k_primary = round(self.ratio * k)
        first = self.stages[0].select(pool, k_primary, shared, exclude)
        taken = torch.zeros_like(pool.candidates)
        taken.scatter_(-1, first, True)
        if exclude is not None:
            taken |= exclude
        second = self.stages[1].select(pool, k - k_primary, shared, taken)
        return torch.cat([first, second], dim=-1)
