"""Capture each attention layer's queries for the selectors, and trigger compression.

The cache sees keys and values in ``update`` but never the queries, and it must not
compress before the block's own attention has run (later tokens of a block attend to
earlier ones that may be evicted). Three hooks per attention module bridge that:

1. a forward pre-hook reads the cache (``cache`` from transformers 5.24, ``past_key_values``
   before) and ``position_embeddings`` (cos, sin) from the call's keyword arguments; it
   arms the module only if the cache is the one that installed the hooks;
2. a forward hook on the query projection (``q_norm`` where the model has one, as Qwen3,
   else ``q_proj``) keeps its output, so the queries are not recomputed;
3. a forward hook on the attention module, after attention, rotates those queries with
   (cos, sin) exactly as the model does and hands them to the layer, which compresses.

The hooks belong to one cache (an :class:`Attachment`) and keep their state in their own
closures: nothing is written onto the model. They hold the cache weakly and are removed
when the cache is detached, leaves its ``with`` block, or is garbage-collected, after which
the model is exactly as it was. They do nothing for forwards with another cache.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref

import torch
from torch import nn

from bmrt_kv.errors import BMRTError
from bmrt_kv.rope import apply_rope

# model -> the attachments living on it, for detach(model). Weak both ways: the registry
# keeps neither a model nor a cache alive.
_ATTACHMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_cache(kwargs: dict):
    """The cache a model call was given: transformers 5.24 renamed the keyword argument
    from ``past_key_values`` to ``cache`` (the old name is still accepted from callers and
    renamed by the model's forward, after forward pre-hooks have run)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def cache_keyword(model: nn.Module) -> str:
    """The keyword this transformers release's ``model(...)`` takes the cache by:
    ``"cache"`` from 5.24, ``"past_key_values"`` before (5.24 still accepts the old name,
    with a FutureWarning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules (they carry ``q_proj`` and ``layer_idx``)."""
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]


class Attachment:
    """The forward hooks one cache installed on one model.

    Args:
        model: the causal LM whose attention modules get the hooks.
        cache: the cache the hooks serve; held by a weak reference.
    """

    def __init__(self, model: nn.Module, cache) -> None:
        modules = attention_modules(model)
        if not modules:
            raise BMRTError(
                f"{type(model).__name__} has no attention modules with q_proj and layer_idx "
                "(supported: Llama, Mistral, Qwen2, Qwen3 families)"
            )
        cache_ref = weakref.ref(cache)
        self.handles: list = []
        for attn in modules:
            state: dict = {}
            projection = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj
            self.handles += [
                attn.register_forward_pre_hook(_pre_hook(cache_ref, state), with_kwargs=True),
                projection.register_forward_hook(_query_hook(state)),
                attn.register_forward_hook(_post_hook(state), with_kwargs=True),
            ]
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        if isinstance(decoder, nn.Module):
            self.handles.append(
                decoder.register_forward_pre_hook(_positions_hook(cache_ref), with_kwargs=True)
            )
        _ATTACHMENTS.setdefault(model, weakref.WeakSet()).add(self)

    @property
    def attached(self) -> bool:
        return bool(self.handles)

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def detach(model: nn.Module) -> None:
    """Remove the hooks of every :class:`~bmrt_kv.BMRTCache` attached to ``model``."""
    for attachment in list(_ATTACHMENTS.pop(model, ())):
        attachment.remove()


@contextlib.contextmanager
def attached(model: nn.Module, config=None, **overrides):
    """``with bmrt_kv.attached(model, config) as cache:`` a :class:`~bmrt_kv.BMRTCache`
    whose hooks are removed when the block ends, error or not; the model is then exactly
    as it was. ``config`` and ``overrides`` are :class:`~bmrt_kv.BMRTCache`'s."""
    from bmrt_kv.cache import BMRTCache

    cache = BMRTCache(model, config, **overrides)
    try:
        yield cache
    finally:
        cache.detach()


def _positions_hook(cache_ref: weakref.ref):
    """Correct transformers 5.2's chunked prefill, which passes every chunk the position ids
    of the prompt's last chunk (``generate(prefill_chunk_size=...)``; fixed in 5.3).

    A position id past its token's cache position cannot happen otherwise (padding only
    lowers position ids), so only that case is touched: the ids are rebuilt from the
    attention mask as transformers >= 5.3 does, or from the cache positions without one.
    """

    def positions_hook(decoder, args, kwargs):
        cache = cache_ref()
        if cache is None or call_cache(kwargs) is not cache:
            return None
        positions, cache_positions = kwargs.get("position_ids"), kwargs.get("cache_position")
        if positions is None or cache_positions is None or positions.ndim != 2:
            return None
        n = cache_positions.shape[0]
        if positions.shape[-1] != n or not bool((positions[:, -1] > cache_positions[-1]).any()):
            return None
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[-1] >= n:
            fixed = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -n:]
        else:
            fixed = cache_positions.unsqueeze(0).expand(positions.shape[0], -1)
        warnings.warn(
            "bmrt-kv: this transformers version passed wrong position ids to a prefill chunk "
            "(transformers 5.2's generate(prefill_chunk_size=...), fixed in 5.3); "
            "bmrt-kv corrected them for its cache",
            stacklevel=2,
        )
        return args, {**kwargs, "position_ids": fixed.to(positions.dtype)}

    return positions_hook


def _pre_hook(cache_ref: weakref.ref, state: dict):
    def pre_hook(attn, args, kwargs):
        state.clear()
        cache = call_cache(kwargs)
        if cache is not None and cache is cache_ref():
            cos, sin = kwargs["position_embeddings"]
            state.update(cache=cache, cos=cos, sin=sin, queries=None)

    return pre_hook


def _query_hook(state: dict):
    def query_hook(module, args, output):
        if state:
            state["queries"] = output

    return query_hook


def _post_hook(state: dict):
    def post_hook(attn, args, kwargs, output):
        if not state:
            return
        cache, cos, sin, raw = state["cache"], state["cos"], state["sin"], state["queries"]
        state.clear()
        b, t = raw.shape[:2]  # raw: (b, T, H * hd) from q_proj or (b, T, H, hd) from q_norm
        queries = raw.reshape(b, t, -1, attn.head_dim)
        with torch.no_grad():
            rotated = apply_rope(queries, cos, sin).transpose(1, 2)  # (b, H, T, hd)
            cache.finish_layer(attn.layer_idx, rotated)

    return post_hook
