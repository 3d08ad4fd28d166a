"""Capture each attention layer's queries for the selectors, and trigger compression.

The cache sees keys and values in ``update`` but never the queries, and it must not
compress before the block's own attention has run (later tokens of a block attend to
earlier ones that may be evicted). Three hooks per attention module bridge that:

1. a forward pre-hook reads ``past_key_values`` and ``position_embeddings`` (cos, sin)
   from the call's keyword arguments; if the cache is a :class:`BMRTCache` it marks the
   module active;
2. a forward hook on the query projection (``q_norm`` where the model has one, as Qwen3,
   else ``q_proj``) keeps its output, so the queries are not recomputed;
3. a forward hook on the attention module, after attention, rotates those queries with
   (cos, sin) exactly as the model does and hands them to the layer, which compresses.

Hooks do nothing when the forward uses another cache, so a model stays usable with
``DynamicCache`` after a :class:`BMRTCache` attached to it.
"""

from __future__ import annotations

import torch
from torch import nn

from bmrt_kv.errors import BMRTError
from bmrt_kv.rope import apply_rope

_HANDLES = "_bmrt_kv_hook_handles"


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules (they carry ``q_proj`` and ``layer_idx``)."""
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]


def attach(model: nn.Module, cache_type: type) -> None:
    """Install the hooks on ``model`` once; later calls are no-ops."""
    if getattr(model, _HANDLES, None):
        return
    modules = attention_modules(model)
    if not modules:
        raise BMRTError(
            f"{type(model).__name__} has no attention modules with q_proj and layer_idx "
            "(supported: Llama, Mistral, Qwen2, Qwen3 families)"
        )
    handles = []
    for attn in modules:
        attn._bmrt_state = None
        handles.append(attn.register_forward_pre_hook(_make_pre_hook(cache_type), with_kwargs=True))
        projection = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj
        handles.append(projection.register_forward_hook(_make_query_hook(attn)))
        handles.append(attn.register_forward_hook(_post_hook, with_kwargs=True))
    setattr(model, _HANDLES, handles)


def detach(model: nn.Module) -> None:
    """Remove the hooks installed by :func:`attach`."""
    for handle in getattr(model, _HANDLES, None) or []:
        handle.remove()
    setattr(model, _HANDLES, None)


def _make_pre_hook(cache_type: type):
    def pre_hook(attn, args, kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, cache_type):
            cos, sin = kwargs["position_embeddings"]
            attn._bmrt_state = {"cache": cache, "cos": cos, "sin": sin, "queries": None}
        else:
            attn._bmrt_state = None

    return pre_hook


def _make_query_hook(attn: nn.Module):
    def query_hook(module, args, output):
        if attn._bmrt_state is not None:
            attn._bmrt_state["queries"] = output

    return query_hook


def _post_hook(attn, args, kwargs, output):
    state = attn._bmrt_state
    if state is None:
        return
    attn._bmrt_state = None
    raw = state["queries"]  # (b, T, H * hd) from q_proj or (b, T, H, hd) from q_norm
    b, t = raw.shape[:2]
    queries = raw.reshape(b, t, -1, attn.head_dim)
    with torch.no_grad():
        rotated = apply_rope(queries, state["cos"], state["sin"]).transpose(1, 2)  # (b,H,T,hd)
        state["cache"].finish_layer(attn.layer_idx, rotated)
