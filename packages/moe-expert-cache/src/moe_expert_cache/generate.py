"""The runtime loop: token t forward -> emit token t -> cache update -> token t + 1."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.manager import ExpertCacheManager


@dataclass
class GenerationResult:
    """Greedy tokens, the prompt's time, and the time of the tokens after the first."""

    tokens: list[int]
    prompt_seconds: float
    decode_seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first over their time."""
        n = len(self.tokens) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def generate(
    model: nn.Module,
    prompt_ids: Sequence[int],
    max_tokens: int,
    manager: ExpertCacheManager | None = None,
) -> GenerationResult:
    """Greedy decoding of ``max_tokens`` tokens after ``prompt_ids``.

    With a ``manager`` (a cached model), the cache updates between tokens; without one the
    same loop runs the stock model, so the two time the same work.

    Args:
        model: An mlx-lm model, cached (``CachedModel.model``) or stock.
        prompt_ids: The prompt's token ids, at least one, each in [0, vocab_size).
        max_tokens: Tokens to generate, >= 1.
        manager: The cached model's ``CachedModel.manager``; ``None`` for a stock model.

    Returns:
        The tokens, the prompt's seconds and the seconds of the tokens after the first
        (``tokens_per_s``).

    Raises:
        ExpertCacheError: ``max_tokens`` < 1, an empty prompt or an id out of range.
    """
    if max_tokens < 1:
        raise ExpertCacheError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(prompt_ids) < 1:
        raise ExpertCacheError("prompt_ids must hold at least one token")
    # An id past the embedding table is an out-of-bounds read inside MLX (a segfault).
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    limit = vocab if isinstance(vocab, int) else 2**31
    bad = [
        t
        for t in prompt_ids
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < limit
    ]
    if bad:
        raise ExpertCacheError(
            f"prompt_ids must be token ids in [0, vocab_size={vocab}), got {bad[:5]}"
        )
    kv = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(mx.array(list(prompt_ids))[None], cache=kv)  # (1, L, vocab)
    y = mx.argmax(logits[:, -1, :], axis=-1)  # (1,)
    tokens = [int(y.item())]
    if manager is not None:
        manager.dynamic_cache_update()
    prompt_done = time.perf_counter()
    for _ in range(max_tokens - 1):
        logits = model(y[:, None], cache=kv)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        tokens.append(int(y.item()))
        if manager is not None:
            manager.dynamic_cache_update()
    end = time.perf_counter()
    return GenerationResult(tokens, prompt_done - start, end - prompt_done)
