"""A sliding-window layer's cache: transformers' own window, with its peak size recorded."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer`` (it keeps the last ``sliding_window - 1``
    tokens between forwards), recording the most tokens it held during a forward.

    A sliding-window layer of a hybrid model (Gemma 2, Gemma 3) is already bounded by its
    window, so :class:`~bmrt_kv.BMRTCache` keeps it as transformers does and bounds only the
    full-attention layers.

    Args:
        sliding_window: the layer's window in tokens (the model config's ``sliding_window``).
    """

    def __init__(self, sliding_window: int):
        super().__init__(sliding_window=sliding_window)
        self.peak_tokens = 0

    @property
    def stored(self) -> int:
        """Tokens held now (at most ``sliding_window - 1`` between forwards)."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a block (b, h, T, hd) and return what attention sees, as transformers does."""
        self.peak_tokens = max(self.peak_tokens, self.stored + key_states.shape[-2])
        return super().update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        """Empty the layer (transformers 5.2's reset zeroes the tensors but keeps their
        size, which a new stream would then attend to)."""
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0
        self.peak_tokens = 0
