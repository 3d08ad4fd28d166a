"""What BMRTCache needs from a model, checked before anything is attached.

Each decoder layer gets the cache layer transformers' own ``DynamicCache`` would give it:
a full-attention layer gets the bounded recursive :class:`~bmrt_kv.layer.BMRTLayer`, a
sliding-window layer keeps transformers' own window (it is already bounded by it). Each
full-attention layer's attention module must expose its queries (``q_proj``, or Phi-3's
fused ``qkv_proj``), optionally normalised by ``q_norm`` (Qwen3, OLMo 2, Gemma 3). Anything
else is refused with :class:`BMRTError` naming the family and what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from bmrt_kv.errors import BMRTError


@dataclass(frozen=True)
class LayerPlan:
    """How one decoder layer is cached.

    Args:
        kind: ``"full"`` (bounded recursive cache) or ``"sliding"`` (transformers' window).
        window: the sliding window in tokens (``None`` for a full layer).
        attention: the layer's attention module (``None`` for a sliding layer).
        rotary: False where the layer applies no rotary embedding (SmolLM3's NoPE layers,
            learned positions): its queries are scored and its keys kept as they are.
    """

    kind: str
    window: int | None = None
    attention: nn.Module | None = None
    rotary: bool = True


def family(model: nn.Module) -> str:
    """The model's transformers ``model_type`` (its text config's), for error messages."""
    text_config = model.config.get_text_config(decoder=True)
    return str(getattr(text_config, "model_type", None) or type(model).__name__)


def query_projection(attn: nn.Module) -> nn.Module | None:
    """The module whose output holds the queries: ``q_proj``, or Phi-3's fused ``qkv_proj``
    (queries first)."""
    for name in ("q_proj", "qkv_proj"):
        if isinstance(getattr(attn, name, None), nn.Module):
            return getattr(attn, name)
    return None


def plan_layers(model: nn.Module) -> list[LayerPlan]:
    """One :class:`LayerPlan` per decoder layer, or :class:`BMRTError` if the model cannot
    be cached. Changes nothing.

    Raises:
        BMRTError: a layer type other than full or sliding-window attention (chunked,
            linear, shared KV), or a full-attention layer whose queries cannot be read.
    """
    name = family(model)
    own = DynamicCache(config=model.config).layers
    modules = {
        m.layer_idx: m
        for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and query_projection(m) is not None
    }
    # OPT-style learned positions: no rotary embedding to apply to the queries.
    has_rotary = any(n.endswith("rotary_emb") for n, _ in model.named_modules())
    plans = []
    for i, layer in enumerate(own):
        if type(layer) is DynamicSlidingWindowLayer:
            plans.append(LayerPlan("sliding", window=int(layer.sliding_window)))
        elif type(layer) is DynamicLayer:
            attn = modules.get(i)
            if attn is None:
                raise BMRTError(
                    f"model_type {name!r}: the attention module of layer {i} has no q_proj "
                    "(or qkv_proj) with a layer_idx, so BMRTCache cannot read its queries"
                )
            if not hasattr(attn, "head_dim"):
                raise BMRTError(f"model_type {name!r}: attention layer {i} has no head_dim")
            rotary = has_rotary and bool(getattr(attn, "use_rope", True))
            plans.append(LayerPlan("full", attention=attn, rotary=rotary))
        else:
            raise BMRTError(
                f"model_type {name!r}: layer {i} uses transformers' {type(layer).__name__}; "
                "BMRTCache supports full-attention and sliding-window layers only"
            )
    text_config = model.config.get_text_config(decoder=True)
    if len(own) != text_config.num_hidden_layers:
        raise BMRTError(
            f"model_type {name!r}: transformers builds {len(own)} cache layers for "
            f"{text_config.num_hidden_layers} decoder layers (layers sharing KV); BMRTCache "
            "needs one cache layer per decoder layer"
        )
    return plans


def rotary_inv_freq(model: nn.Module) -> torch.Tensor:
    """The inverse frequencies of the full-attention layers' rotary embedding (Gemma 3 keeps
    one set per layer type in one module), for ``positions="rerotate"``.

    Raises:
        BMRTError: the model has no rotary embedding module with inverse frequencies.
    """
    for module_name, module in model.named_modules():
        if module_name.endswith("rotary_emb"):
            for attribute in ("full_attention_inv_freq", "inv_freq"):
                inv_freq = getattr(module, attribute, None)
                if isinstance(inv_freq, torch.Tensor):
                    return inv_freq.detach().clone()
    raise BMRTError(
        f"model_type {family(model)!r}: positions='rerotate' needs the model's rotary "
        "embedding (a rotary_emb module with inv_freq); this model has none"
    )
