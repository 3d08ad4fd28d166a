"""The cache configuration: budget split, block size, selector and modes, validated up front."""

from __future__ import annotations

from dataclasses import dataclass, field

SCORING_MODES = ("agnostic", "query_aware")
POSITION_MODES = ("absolute", "rerotate")
GRANULARITIES = ("head", "layer")


@dataclass
class BMRTConfig:
    """How a :class:`~bmrt_kv.BMRTCache` bounds and compresses each layer.

    The budget ``budget`` (B tokens per layer) is split by ``protection_divisor`` n into
    ``n_anchor = B // n`` global anchors (the first tokens of the stream, always kept),
    ``n_window = B // n`` local-window tokens (the most recent, always kept) and
    ``n_memory = B - n_anchor - n_window`` long-term slots filled by ``selector``.

    Args:
        budget: B, the most tokens a layer holds between blocks and decoding steps.
        protection_divisor: n >= 3.
        block_size: tokens per prefill block; a layer holds at most B + block_size tokens
            while a block is processed.
        selector: a name registered in :data:`bmrt_kv.SELECTORS`.
        selector_options: keyword arguments of that selector's constructor.
        scoring: ``"agnostic"`` (relevance to the current block) or ``"query_aware"``
            (a known question is appended to each block's scoring queries).
        question_weight: in query-aware scoring, the share of the scoring weight the
            question's queries get together (the block's queries share the rest), in
            (0, 1]. 0.5 (the default) weighs the question as much as the block; 1 scores
            by the question alone.
        positions: ``"absolute"`` (kept tokens keep their position ids) or ``"rerotate"``
            (kept keys are re-rotated to contiguous positions just before the next query).
        granularity: ``"head"`` (each KV head selects its own tokens) or ``"layer"``
            (one shared index for all KV heads of a layer, scores summed over heads).
        seed: seeds the selectors' random projections (LSH), one generator per layer.
    """

    budget: int = 1024
    protection_divisor: int = 8
    block_size: int = 512
    selector: str = "exact"
    selector_options: dict = field(default_factory=dict)
    scoring: str = "agnostic"
    question_weight: float = 0.5
    positions: str = "absolute"
    granularity: str = "head"
    seed: int = 0

    def __post_init__(self) -> None:
        from bmrt_kv.selectors import SELECTORS, make_selector

        if not isinstance(self.protection_divisor, int) or self.protection_divisor < 3:
            raise ValueError(
                f"protection_divisor must be an int >= 3, got {self.protection_divisor!r}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"budget must be a positive int, got {self.budget!r}")
        if self.n_anchor < 1 or self.n_memory < 1:
            raise ValueError(
                f"budget={self.budget} is too small for protection_divisor="
                f"{self.protection_divisor}: it must hold at least one anchor, one window "
                f"token and one memory slot (budget >= {2 * self.protection_divisor - 1} "
                "with at least one memory slot left after 2 * budget // protection_divisor)"
            )
        if (
            isinstance(self.question_weight, bool)
            or not isinstance(self.question_weight, (int, float))
            or not 0.0 < self.question_weight <= 1.0
        ):
            raise ValueError(f"question_weight must be in (0, 1], got {self.question_weight!r}")
        if self.selector not in SELECTORS:
            raise ValueError(f"selector must be one of {sorted(SELECTORS)}, got {self.selector!r}")
        for name, value, allowed in (
            ("scoring", self.scoring, SCORING_MODES),
            ("positions", self.positions, POSITION_MODES),
            ("granularity", self.granularity, GRANULARITIES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        # Build once so that bad selector options fail here, not mid-stream.
        make_selector(self.selector, self.selector_options)

    @property
    def n_anchor(self) -> int:
        return self.budget // self.protection_divisor

    @property
    def n_window(self) -> int:
        return self.budget // self.protection_divisor

    @property
    def n_memory(self) -> int:
        return self.budget - self.n_anchor - self.n_window
