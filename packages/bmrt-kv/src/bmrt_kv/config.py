"""The cache configuration: budget split, block size, selector and modes, validated up front."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from bmrt_kv.errors import MAX_TOKENS, BMRTError, check_choice, check_fraction, check_int

SCORING_MODES = ("agnostic", "query_aware")
POSITION_MODES = ("absolute", "rerotate")
GRANULARITIES = ("head", "layer")
#: Largest BMRTConfig.seed: layer i seeds its selector with seed * 100_003 + i, which must
#: stay a valid torch seed.
MAX_SEED = 2**32 - 1
#: The largest block ``BMRTConfig(block_size=None)`` resolves to: min(512, budget), or
#: min(512, 2 * budget) under query-aware scoring.
DEFAULT_BLOCK_SIZE = 512


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
            while a block is processed. ``None`` (the default) depends on ``scoring``:
            agnostic, ``min(DEFAULT_BLOCK_SIZE, budget)``, i.e. 512, or the budget when
            that is smaller, so each step keeps at least half of what it scores (at 8k
            tokens and B = 256, a 256-token block answered 29 of 60 agnostic samples where
            a 512-token block answered 10, with a third less peak KV); query-aware,
            ``min(DEFAULT_BLOCK_SIZE, 2 * budget)``: the question steers the selection,
            and at B = 256 the 512-token block answered more (36 against 34 of 140 at 8k,
            43 against 40 at 4k; below B = 256 not measured). The field keeps ``None``
            (so ``replace(config, budget=...)`` follows the new budget);
            :attr:`block_tokens` is the size in effect.
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
        seed: seeds the selectors' random projections (LSH), one generator per layer; an
            int in [0, 2**32 - 1].
        decode_block: k, decoding steps (one-token forwards) compressed together, in
            [1, block size]. 1 (the default) compresses after every step once the budget
            is full. k > 1 holds up to k - 1 decoded tokens above the budget and
            compresses once every k steps, scoring with those k steps' queries (a
            stateful selector scores with what it accumulated): a k-th of the
            compressions, whose cost is mostly per call (SmolLM2-135M, B = 32, snapkv, 2
            cores: 72-80 ms a step compressing every step, 61-62 ms with k = 16, 57 ms
            with transformers' unbounded cache). A layer then holds up to
            ``budget + k - 1`` tokens between steps; during a forward, still at most
            ``budget + block_size``. A block fed after held steps compresses them first.

    Every field is checked at construction (types included: ``True`` is not an int here,
    ``1.0`` is not a block size); a bad value raises :class:`~bmrt_kv.BMRTError` naming
    the field and its allowed range. Token counts are at most ``2**31 - 1``.
    """

    budget: int = 1024
    protection_divisor: int = 8
    block_size: int | None = None
    # keydiff: the best query-agnostic selector measured (pass key at 7.5k tokens, B=1024,
    # 20 samples: 12/20 against the full cache's 13/20 and the design's exact's 0/20), and
    # the one generate() can use, which never sees a question.
    selector: str = "keydiff"
    selector_options: dict = field(default_factory=dict)
    scoring: str = "agnostic"
    question_weight: float = 0.5
    positions: str = "absolute"
    granularity: str = "head"
    seed: int = 0
    decode_block: int = 1

    def __post_init__(self) -> None:
        from bmrt_kv.selectors import SELECTORS, make_selector

        check_int("BMRTConfig.budget", self.budget, 1, MAX_TOKENS)
        check_int("BMRTConfig.protection_divisor", self.protection_divisor, 3, MAX_TOKENS)
        if self.block_size is not None:
            check_int("BMRTConfig.block_size", self.block_size, 1, MAX_TOKENS)
        if self.n_anchor < 1 or self.n_memory < 1:
            raise BMRTError(
                f"BMRTConfig.budget={self.budget} is too small for protection_divisor="
                f"{self.protection_divisor}: it must hold at least one anchor, one window "
                f"token and one memory slot (budget >= {2 * self.protection_divisor - 1} "
                "with at least one memory slot left after 2 * budget // protection_divisor)"
            )
        check_choice("BMRTConfig.selector", self.selector, SELECTORS)
        if not isinstance(self.selector_options, dict):
            raise BMRTError(
                "BMRTConfig.selector_options must be a dict of the selector's options, got "
                f"{self.selector_options!r}"
            )
        check_choice("BMRTConfig.scoring", self.scoring, SCORING_MODES)
        self.question_weight = check_fraction(
            "BMRTConfig.question_weight", self.question_weight, low_open=True
        )
        check_choice("BMRTConfig.positions", self.positions, POSITION_MODES)
        check_choice("BMRTConfig.granularity", self.granularity, GRANULARITIES)
        check_int("BMRTConfig.seed", self.seed, 0, MAX_SEED)
        check_int("BMRTConfig.decode_block", self.decode_block, 1, MAX_TOKENS)
        if self.decode_block > self.block_tokens:
            raise BMRTError(
                f"BMRTConfig.decode_block={self.decode_block} must be at most the block size "
                f"in effect ({self.block_tokens}): a layer holding decode_block - 1 steps "
                "above the budget must still take one more token within budget + block_size"
            )
        # Build once so that bad selector options fail here, not mid-stream.
        make_selector(self.selector, self.selector_options, seed=self.seed)

    @classmethod
    def from_dict(cls, data) -> BMRTConfig:
        """A config from a mapping of field names (e.g. parsed JSON); unknown keys are an
        error, not ignored, so a misspelt field cannot fall back to its default unseen.

        Args:
            data: a dict of :class:`BMRTConfig` field names to values.

        Returns:
            The validated config.

        Raises:
            BMRTError: not a dict of names, an unknown field, or a bad value.
        """
        if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
            raise BMRTError(f"a BMRTConfig needs a dict of field names, got {data!r:.80}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BMRTError(f"unknown BMRTConfig fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    @property
    def block_tokens(self) -> int:
        """The most new tokens one forward may carry: ``block_size``, or when it is None
        ``min(DEFAULT_BLOCK_SIZE, budget)`` (agnostic scoring) or
        ``min(DEFAULT_BLOCK_SIZE, 2 * budget)`` (query-aware)."""
        if self.block_size is not None:
            return self.block_size
        if self.scoring == "query_aware":
            return min(DEFAULT_BLOCK_SIZE, 2 * self.budget)
        return min(DEFAULT_BLOCK_SIZE, self.budget)

    @property
    def n_anchor(self) -> int:
        return self.budget // self.protection_divisor

    @property
    def n_window(self) -> int:
        return self.budget // self.protection_divisor

    @property
    def n_memory(self) -> int:
        return self.budget - self.n_anchor - self.n_window
