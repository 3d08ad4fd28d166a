"""Speculative prefetch, the mixtral-offloading trick: guess a MoE layer's experts by
applying its router to the previous layer's output, and read them while it runs attention.

The decoder layer of every MoE layer but the first is given a subclass of its own class
whose ``__call__`` first takes the guess from its input ``x`` (the previous layer's output):
the layer's own pre-MoE norm (``post_attention_layernorm`` in every supported architecture)
and router, top-k. Reading the guess is one synchronisation (it evaluates the previous
layer). The guessed experts that are not resident are then read from the mmap'd shards on
one background thread, while the main thread builds the layer's attention and evaluates it
up to the router's choice, the synchronisation point of exact mode. MLX releases the GIL
while it evaluates, and the read's CRC-32 over the byte range (where a cold page faults in)
releases it too, so the read overlaps the attention; only its copy into an MLX array holds
the GIL. The block then waits for what is left of the read: that wait, with the reads of
the experts the guess missed, is the stall that remains.

The read rows are staged, not written into slots: the block makes the experts its tokens
need resident as without prefetch (the same victims, chosen by the same policy, never one
the tokens need), taking the staged rows instead of reading them again, and drops the
rest. A wrong guess costs a read, never a wrong output, and evicts nothing; the resident
stacks keep ``capacity`` experts, and at most ``top_k`` staged experts of one layer are
held besides them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.layer_cache import LayerCache

NORM = "post_attention_layernorm"


class SpeculativePrefetch:
    """The guesses and background reads of one cached model.

    ``targets``: MoE layer number -> ``(cache, block, norm)``: its :class:`LayerCache`, its
    cached MoE block (whose ``route`` is the stock router) and its pre-MoE norm.
    """

    def __init__(self):
        # One worker: reads of consecutive layers never overlap (each is taken by its
        # block before the next layer guesses).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-prefetch")
        self.targets: dict[int, tuple[LayerCache, nn.Module, nn.Module]] = {}

    def add(self, index: int, decoder_layer: nn.Module, block: nn.Module) -> None:
        """Prefetch for MoE layer ``index`` (``block``, inside ``decoder_layer``) before the
        decoder layer runs."""
        check_decoder_layer(decoder_layer)
        self.targets[index] = (block.cache, block, getattr(decoder_layer, NORM))
        _prefetch_before_each_call(decoder_layer, lambda x: self.start(index, x))

    def guess(self, index: int, x: mx.array) -> np.ndarray:
        """x: (B, L, D) float, the input of MoE layer ``index``'s decoder layer -> the
        experts its router would choose on it, (B * L, k) int."""
        _, block, norm = self.targets[index]
        inds, _ = block.route(norm(x).reshape(-1, x.shape[-1]))  # (B * L, k)
        return np.array(inds)

    def start(self, index: int, x: mx.array) -> None:
        """Guess MoE layer ``index``'s experts from ``x`` and start reading the missing ones."""
        cache = self.targets[index][0]
        if not cache.full:
            cache.start_prefetch(self.guess(index, x), self._executor)


def check_decoder_layer(decoder_layer: nn.Module) -> None:
    """Refuse a decoder layer without the pre-MoE norm the guess applies."""
    if not isinstance(getattr(decoder_layer, NORM, None), nn.Module):
        raise ExpertCacheError(
            f"prefetch: {type(decoder_layer).__name__} has no {NORM} before its MoE block"
        )


_HOOKED_LAYERS: dict[type, type] = {}


def _prefetch_before_each_call(layer: nn.Module, start) -> None:
    """Give decoder layer ``layer`` a subclass of its class whose ``__call__`` first runs
    ``start(x)`` on its input (Python looks ``__call__`` up on the type)."""
    stock = type(layer)
    if stock not in _HOOKED_LAYERS:

        def __call__(self, x, *args, **kwargs):
            self.expert_prefetch(x)
            return stock.__call__(self, x, *args, **kwargs)

        _HOOKED_LAYERS[stock] = type(
            f"Prefetching{stock.__name__}",
            (stock,),
            {"__call__": __call__, "__module__": stock.__module__},
        )
    layer.__class__ = _HOOKED_LAYERS[stock]
    layer.expert_prefetch = start
