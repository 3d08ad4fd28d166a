"""One decoder layer's bounded KV store, a transformers ``CacheLayerMixin``."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from bmrt_kv.compress import keep_indices, protected_mask
from bmrt_kv.config import BMRTConfig
from bmrt_kv.errors import BMRTError
from bmrt_kv.rope import rerotate
from bmrt_kv.selectors import Pool, Selector
from bmrt_kv.selectors.attention import attention_mass


class BMRTLayer(CacheLayerMixin):
    """Holds at most ``budget`` tokens between forwards and ``budget + block_size`` during one
    (with ``decode_block`` k > 1, up to ``budget + k - 1`` between decoding steps).

    ``keys``/``values`` are (b, h, S, hd); ``positions`` (b, h, S) int64 holds each token's
    original position, sorted ascending per head. Heads may keep different tokens
    (granularity ``"head"``); their counts are always equal.

    The transformers forward calls :meth:`update` (append, return everything for
    attention); the attention module's forward hook then calls :meth:`finish`, which
    compresses back to the budget with the block's queries.

    Args:
        config: the cache's :class:`BMRTConfig`.
        selector: this layer's selector.
        inv_freq: (rd / 2,) rotary inverse frequencies to re-rotate kept keys with
            (``positions="rerotate"``); ``None`` keeps keys where they are (absolute
            positions, or a layer without rotary embedding).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, config: BMRTConfig, selector: Selector, inv_freq: torch.Tensor | None):
        super().__init__()  # keys, values = None; is_initialized = False
        self.config = config
        self.selector = selector
        self.inv_freq = inv_freq
        self.seen = 0
        self.positions: torch.Tensor | None = None
        self.accumulated: torch.Tensor | None = None
        # Sum of the unit-normalised keys of every token seen (keydiff's "stream" anchor).
        self.key_sum: torch.Tensor | None = None
        self.peak_tokens = 0
        # Decoding steps not compressed yet (decode_block > 1): their rotated queries
        # (b, H, t, hd) and the position of the first.
        self.held_queries: torch.Tensor | None = None
        self.held_from = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, hd = key_states.shape
        self.keys = key_states.new_zeros(b, h, 0, hd)
        self.values = value_states.new_zeros(b, h, 0, value_states.shape[-1])
        self.positions = torch.zeros(b, h, 0, dtype=torch.int64, device=self.device)
        self.accumulated = torch.zeros(b, h, 0, dtype=torch.float32, device=self.device)
        self.key_sum = None
        if self.selector.needs_key_sum:
            self.key_sum = torch.zeros(b, h, hd, dtype=torch.float32, device=self.device)
        self.is_initialized = True

    @property
    def stored(self) -> int:
        """Tokens held now (S)."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a block. key_states, value_states: (b, h, T, hd), rotated at positions
        ``seen .. seen + T - 1``. Returns the (b, h, S + T, hd) keys and values."""
        n_new = key_states.shape[-2]
        limit = self.config.budget + self.config.block_tokens
        if self.held_queries is not None and n_new > 1:
            # A block after held decoding steps: they are compressed first, with their own
            # queries, so the block starts from the budget as it would without holding.
            self._compress(self._pool(self.held_queries, self.held_from, 0))
        if self.stored > self.config.budget and self.held_queries is None:
            raise RuntimeError(
                f"the layer still holds {self.stored} > budget={self.config.budget} tokens: "
                "the previous forward was not finished; was the model passed to BMRTCache?"
            )
        if self.stored + n_new > limit:
            raise BMRTError(
                f"a block of {n_new} tokens on top of {self.stored} cached exceeds "
                f"budget + block_size = {limit}; feed at most block_size="
                f"{self.config.block_tokens} tokens per forward (generate(..., "
                "prefill_chunk_size=block_size) or BoundedStream)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h = key_states.shape[:2]
        new_positions = torch.arange(self.seen, self.seen + n_new, device=self.device)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.positions = torch.cat([self.positions, new_positions.expand(b, h, n_new)], dim=-1)
        self.accumulated = torch.cat(
            [self.accumulated, self.accumulated.new_zeros(b, h, n_new)], -1
        )
        self.peak_tokens = max(self.peak_tokens, self.stored)
        return self.keys, self.values

    def needs_queries(self, n_scoring_only: int) -> bool:
        """Whether :meth:`finish` of the forward now ending uses its queries: a stateful
        selector scores every forward; a stateless one only where the layer (less the
        ``n_scoring_only`` tokens it drops) holds more than the budget. Otherwise the
        attention hook passes ``queries=None`` and does not rotate them.

        Args:
            n_scoring_only: trailing tokens of this forward that only score (as
                :meth:`finish` takes them).
        """
        return self.selector.stateful or self.stored - n_scoring_only > self.config.budget

    def finish(
        self, queries: torch.Tensor | None, n_scoring_only: int, n_forward: int | None = None
    ) -> None:
        """Compress after the block's attention.

        Args:
            queries: (b, H, T, hd) rotated queries of this forward (H query heads); None
                where :meth:`needs_queries` is False (then ``n_forward`` gives T).
            n_scoring_only: trailing tokens of this forward that only score (the question
                in query-aware mode): dropped from the cache and not counted as seen.
            n_forward: T, where ``queries`` is None.
        """
        if queries is None:
            if n_forward is None or self.needs_queries(n_scoring_only):
                raise RuntimeError(
                    "BMRTLayer.finish: queries are needed here (a stateful selector, or the "
                    "layer above its budget); None needs n_forward and no compression"
                )
        else:
            n_forward = queries.shape[-2]
        if n_scoring_only:
            self._take(slice(0, self.stored - n_scoring_only))
        previous_seen = self.seen
        n_new = n_forward - n_scoring_only
        self.seen += n_new
        if self.key_sum is not None and n_new:
            new_keys = self.keys[:, :, self.stored - n_new :].to(torch.float32)
            self.key_sum = self.key_sum + torch.nn.functional.normalize(new_keys, dim=-1).sum(2)
        stateful = self.selector.stateful
        pool = self._pool(queries, previous_seen, n_scoring_only) if stateful else None
        if stateful:
            self.accumulated = self.accumulated + attention_mass(pool)
            pool.accumulated = self.accumulated
        if self.stored <= self.config.budget:
            return
        if n_forward == 1 and not n_scoring_only and self.config.decode_block > 1:
            held = self.held_queries
            if held is None:
                self.held_queries, self.held_from = queries, previous_seen
            else:
                self.held_queries = torch.cat([held, queries], dim=-2)
            if self.stored < self.config.budget + self.config.decode_block:
                return  # held: compressed once decode_block steps are above the budget
            if not stateful:  # scored with every held step's queries
                queries, previous_seen = self.held_queries, self.held_from
        if pool is None:  # a stateless selector scores here (with the held steps' queries)
            pool = self._pool(queries, previous_seen, n_scoring_only)
        self._compress(pool)

    def _compress(self, pool: Pool) -> None:
        """Keep the budget's tokens of ``pool`` (the layer's tokens now), chosen by the
        selector; nothing is held afterwards."""
        self.held_queries = None
        keep = keep_indices(pool, self.seen, self.config, self.selector)
        old_stored = self.stored
        self._gather(keep)
        if self.config.positions == "rerotate" and self.inv_freq is not None:
            # The pool sat contiguously at [seen - old_stored, seen); the kept tokens close
            # the gaps, so kept token j moves to seen - S + j, just before the next query.
            old_slot = keep + (self.seen - old_stored)
            new_slot = torch.arange(self.stored, device=self.device) + (self.seen - self.stored)
            self.keys = rerotate(self.keys, new_slot - old_slot, self.inv_freq)

    def _pool(self, queries: torch.Tensor, previous_seen: int, n_scoring_only: int) -> Pool:
        b, n_heads, t, hd = queries.shape
        h = self.keys.shape[1]
        groups = n_heads // h
        weights = None
        if n_scoring_only:
            # The question gets `question_weight` of the scoring weight (by default as much
            # as the block): summed over its few queries it would otherwise vanish next to
            # the block's many.
            # Both shares are doubled so that the default keeps the 0.2.0 weights (1 / n
            # per query on each side), which h2o's accumulated mass is compared against.
            share = 2.0 * float(self.config.question_weight)
            is_question = torch.arange(t, device=self.device) >= t - n_scoring_only
            per_query = torch.where(
                is_question, share / n_scoring_only, (2.0 - share) / max(t - n_scoring_only, 1)
            )
            weights = per_query.repeat(groups)
        # Query head g*... of KV head j is j * G + g (transformers' repeat_kv layout).
        grouped = queries.reshape(b, h, groups * t, hd)
        query_positions = torch.arange(previous_seen, previous_seen + t, device=self.device)
        return Pool(
            keys=self.keys,
            positions=self.positions,
            queries=grouped,
            query_positions=query_positions.repeat(groups),
            candidates=~protected_mask(self.positions, self.seen, self.config),
            query_groups=groups,
            accumulated=self.accumulated,
            query_weights=weights,
            n_question=n_scoring_only,
            key_sum=self.key_sum,
        )

    def _gather(self, index: torch.Tensor) -> None:
        hd_k, hd_v = self.keys.shape[-1], self.values.shape[-1]
        self.keys = self.keys.gather(2, index.unsqueeze(-1).expand(*index.shape, hd_k))
        self.values = self.values.gather(2, index.unsqueeze(-1).expand(*index.shape, hd_v))
        self.positions = self.positions.gather(2, index)
        self.accumulated = self.accumulated.gather(2, index)

    def _take(self, span: slice) -> None:
        self.keys = self.keys[:, :, span]
        self.values = self.values[:, :, span]
        self.positions = self.positions[:, :, span]
        self.accumulated = self.accumulated[:, :, span]

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        """(kv_length, kv_offset): the S cached tokens map to positions [seen - S, seen),
        all before the queries, so the causal mask shows all of them and masks the block
        causally. Accepts an int (transformers >= 5.3) or a cache_position tensor (5.2).
        A block after held decoding steps sees the budget's tokens: update() compresses
        the held steps before appending it."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        stored = self.stored
        if self.held_queries is not None and query_length > 1:
            stored = self.config.budget  # update() compresses the held steps first
        return stored + query_length, self.seen - stored

    def get_seq_length(self) -> int:
        """Tokens of the stream seen so far (not the tokens held): position ids continue
        from here and generate() slices its inputs by it."""
        return self.seen

    def get_max_length(self) -> int:
        """-1: the stream has no maximum length (only the cache is bounded)."""
        return -1

    def get_max_cache_shape(self) -> int:
        """The same as :meth:`get_max_length`, under its transformers < 5.3 name."""
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.positions = self.accumulated = None
        self.key_sum = None
        self.held_queries = None
        self.is_initialized = False
        self.seen = 0
        self.peak_tokens = 0
