"""Capture each attention layer's queries for the selectors, and trigger compression.

The cache sees keys and values in ``update`` but never the queries, and it must not
compress before the block's own attention has run (later tokens of a block attend to
earlier ones that may be evicted). Three hooks per attention module bridge that:

1. a forward pre-hook reads the cache (``cache`` from transformers 5.24, ``past_key_values``
   before) and ``position_embeddings`` (cos, sin) from the call's keyword arguments; it
   arms the module only if the cache is the one that installed the hooks;
2. a forward hook on the query projection (``q_proj``, or the queries of Phi-3's fused
   ``qkv_proj``) keeps its output, so the projection is not recomputed;
3. a forward hook on the attention module, after attention, applies the module's own
   ``q_norm`` where it has one (Qwen3, OLMo 2, Gemma 3), rotates the queries with (cos, sin)
   exactly as the model does (not in SmolLM3's NoPE layers) and hands them to the layer,
   which compresses.

Only full-attention layers get these hooks: a sliding-window layer keeps transformers' own
window. A pre-hook on the decoder refuses padded input (an attention mask with zeros) before
any layer has run, and corrects transformers 5.2's chunked-prefill position ids and cache
positions.

The hooks belong to one cache (an :class:`Attachment`) and keep their state in their own
closures: nothing is written onto the model. They hold the cache weakly and are removed
when the cache is detached, leaves its ``with`` block, or is garbage-collected, after which
the model is exactly as it was. They do nothing for forwards with another cache.
"""

from __future__ import annotations

import inspect
import warnings
import weakref

import torch
from torch import nn

from bmrt_kv.errors import BMRTError
from bmrt_kv.rope import apply_rope
from bmrt_kv.support import LayerPlan, query_projection

# model -> the attachments living on it, for detach(model). Weak both ways: the registry
# keeps neither a model nor a cache alive.
_ATTACHMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_cache(kwargs: dict):
    """The cache a model call was given: transformers 5.24 renamed the keyword argument
    from ``past_key_values`` to ``cache`` (the old name is still accepted from callers and
    renamed by the model's forward, after forward pre-hooks have run).

    Args:
        kwargs: the keyword arguments of a model or attention call.

    Returns:
        The cache passed under either name, or None.
    """
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def cache_keyword(model: nn.Module) -> str:
    """The keyword this transformers release's ``model(...)`` takes the cache by:
    ``"cache"`` from 5.24, ``"past_key_values"`` before (5.24 still accepts the old name,
    with a FutureWarning).

    Args:
        model: a transformers model.

    Returns:
        ``"cache"`` or ``"past_key_values"``.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Attachment:
    """The forward hooks one cache installed on one model.

    Args:
        model: the causal LM whose full-attention modules get the hooks.
        cache: the cache the hooks serve; held by a weak reference.
        plans: the model's :class:`~bmrt_kv.support.LayerPlan` list (checked already).
    """

    def __init__(self, model: nn.Module, cache, plans: list[LayerPlan]) -> None:
        cache_ref = weakref.ref(cache)
        self.handles: list = []
        for plan in plans:
            if plan.kind != "full":
                continue
            attn, state = plan.attention, {}
            self.handles += [
                attn.register_forward_pre_hook(_pre_hook(cache_ref, state), with_kwargs=True),
                query_projection(attn).register_forward_hook(_query_hook(state)),
                attn.register_forward_hook(_post_hook(state, plan.rotary), with_kwargs=True),
            ]
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        if isinstance(decoder, nn.Module):
            self.handles.append(
                decoder.register_forward_pre_hook(_decoder_hook(cache_ref), with_kwargs=True)
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
    """Remove the hooks of every :class:`~bmrt_kv.BMRTCache` attached to ``model``
    (idempotent); the model is then as it was.

    Args:
        model: a model any number of caches (none included) were attached to.
    """
    for attachment in list(_ATTACHMENTS.pop(model, ())):
        attachment.remove()


def _decoder_hook(cache_ref: weakref.ref):
    """Refuse padded input, and correct transformers 5.2's chunked prefill, which passes
    every chunk the position ids of the prompt's last chunk (``generate(prefill_chunk_size=
    ...)``; fixed in 5.3).

    A padded batch is refused because each row would be compressed at the batch's block
    boundaries and positions, with its pads among the candidates, not as it is alone. The
    check runs before any layer does, so a refused forward leaves the cache as it was.

    A position id past its token's cache position cannot happen otherwise (padding only
    lowers position ids), so only that case is touched: the ids are rebuilt from the
    cache positions as transformers >= 5.3 does. A cache position must start at the
    tokens the cache has seen; one that does not is rebuilt from that count.
    """

    def decoder_hook(decoder, args, kwargs):
        cache = cache_ref()
        if cache is None or call_cache(kwargs) is not cache:
            return None
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all()):
            rows = torch.nonzero(~mask.bool().all(dim=-1)).flatten().tolist()
            raise BMRTError(
                f"BMRTCache does not support padded input: rows {rows} of the attention mask "
                "have padding; pass one prompt at a time (batch size 1), or rows of equal "
                "length without padding"
            )
        positions, cache_positions = kwargs.get("position_ids"), kwargs.get("cache_position")
        if positions is None or cache_positions is None or positions.ndim != 2:
            return None
        n, seen = cache_positions.shape[0], cache.get_seq_length()
        fixed = {}
        # 5.2 also starts decoding after a chunked prefill one cache position too far
        # (cache_position [31] for the token at position 30), which moves a sliding
        # window's mask by one token.
        if cache_positions.ndim == 1 and int(cache_positions[0]) != seen:
            cache_positions = torch.arange(
                seen, seen + n, dtype=cache_positions.dtype, device=cache_positions.device
            )
            fixed["cache_position"] = cache_positions
        if positions.shape[-1] == n and bool((positions[:, -1] > cache_positions[-1]).any()):
            expanded = cache_positions.unsqueeze(0).expand(positions.shape[0], -1)
            fixed["position_ids"] = expanded.to(positions.dtype)
        if not fixed:
            return None
        warnings.warn(
            "bmrt-kv: this transformers version passed wrong position ids or cache positions "
            "to a chunked prefill (transformers 5.2's generate(prefill_chunk_size=...), fixed "
            f"in 5.3); bmrt-kv corrected {' and '.join(sorted(fixed))} for its cache",
            stacklevel=2,
        )
        return args, {**kwargs, **fixed}

    return decoder_hook


def _pre_hook(cache_ref: weakref.ref, state: dict):
    def pre_hook(attn, args, kwargs):
        state.clear()
        cache = call_cache(kwargs)
        if cache is not None and cache is cache_ref():
            cos, sin = kwargs.get("position_embeddings") or (None, None)
            state.update(cache=cache, cos=cos, sin=sin, queries=None)

    return pre_hook


def _query_hook(state: dict):
    def query_hook(module, args, output):
        if state:
            state["queries"] = output

    return query_hook


def _post_hook(state: dict, rotary: bool):
    def post_hook(attn, args, kwargs, output):
        if not state:
            return
        cache, cos, sin, raw = state["cache"], state["cos"], state["sin"], state["queries"]
        state.clear()
        b, t = raw.shape[:2]  # raw: (b, T, H * hd) from q_proj, (b, T, (H + 2 h) hd) qkv_proj
        if not cache.needs_queries(attn.layer_idx):
            cache.finish_layer(attn.layer_idx, None, t)  # nothing to score: not rotated
            return
        n_heads = attn.config.num_attention_heads
        with torch.no_grad():
            queries = raw[..., : n_heads * attn.head_dim]  # (b, T, H * hd)
            norm = getattr(attn, "q_norm", None)
            if isinstance(norm, nn.Module):
                # OLMo 2 normalises all heads together, Qwen3 and Gemma 3 each head.
                per_head = getattr(norm, "weight", None) is not None and (
                    norm.weight.shape[-1] == attn.head_dim
                )
                queries = norm(queries.reshape(b, t, n_heads, -1) if per_head else queries)
            queries = queries.reshape(b, t, n_heads, attn.head_dim)  # (b, T, H, hd)
            if rotary:
                queries = apply_rope(queries, cos, sin)
            cache.finish_layer(attn.layer_idx, queries.transpose(1, 2))  # (b, H, T, hd)

    return post_hook
