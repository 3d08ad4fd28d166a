"""Hugging Face decoder configs (Llama, Mistral, Qwen2/3, Phi-3, OLMo 2, Gemma 2/3, Granite,
SmolLM3) as SDAR configs.

All of them are SDAR's transformer (RMSNorm, RoPE, GQA, a gated MLP) under the same tensor
names, give or take switches (:class:`~diffulex_edge.config.SDARConfig`): Qwen3 (and SDAR)
normalise each query and key head, OLMo 2 the whole q and k projections; Qwen2 adds biases
to the q/k/v projections; Gemma scales the embedding by sqrt(hidden_size), puts RMSNorms
before and after each branch with ``1 + weight`` gains, gates its MLP with tanh-gelu (GeGLU)
and mixes sliding-window layers with full ones (Gemma 2 also soft-caps scores and logits);
Granite multiplies the embedding, each residual branch and the logits by constants;
SmolLM3 leaves RoPE out of every few layers. Phi-3 fuses q/k/v and gate/up into single
tensors, which :func:`diffulex_edge.hf_import.from_hf_model` splits. A feature this model
does not implement (RoPE scaling, biases on other projections, another activation, a
partial rotary factor) is refused by name rather than computed wrongly.
"""

from __future__ import annotations

from diffulex_edge.errors import DiffulexEdgeError

_PRE = {"qk_norm": False, "qkv_bias": False}
_GEMMA = {"norm_layout": "sandwich", "norm_unit_offset": True, "qkv_bias": False}
# model_type -> the switches its architecture fixes.
ARCHITECTURES = {
    "llama": _PRE,
    "mistral": _PRE,
    "qwen2": {"qk_norm": False, "qkv_bias": True},
    "qwen3": {"qk_norm": True, "qkv_bias": False},
    "phi3": _PRE,
    "olmo2": {"qk_norm": True, "qk_norm_per_head": False, "norm_layout": "post", "qkv_bias": False},
    "gemma2": {**_GEMMA, "qk_norm": False},
    "gemma3_text": {**_GEMMA, "qk_norm": True},
    "granite": _PRE,
    "smollm3": _PRE,
}
# transformers' own default when a config.json leaves rope_theta out (all these classes).
HF_DEFAULT_ROPE_THETA = 10000.0
# The gate activation each family's MLP may use here (the config key differs: Gemma's
# is hidden_activation).
_ACTIVATIONS = {"gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh"}
_COPIED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "eos_token_id",
)


def _default_rope(model_type: str, params, where: str = "") -> float | None:
    """rope_theta of one rope_parameters object (None if it has none); anything but the
    default (unscaled, full) RoPE is refused."""
    if not isinstance(params, dict):
        raise DiffulexEdgeError(f"rope_parameters{where} must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise DiffulexEdgeError(
            f"{model_type} config uses rope_type {kind!r}{where}; only the default (unscaled) "
            "RoPE is implemented"
        )
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise DiffulexEdgeError(
            f"{model_type} config has partial_rotary_factor {factor!r}; only RoPE over the "
            "whole head is implemented"
        )
    return params.get("rope_theta")


def _rope_thetas(model_type: str, data: dict) -> tuple[float, float | None]:
    """(rope_theta, the sliding layers' own theta or None) from ``rope_parameters``
    (transformers 5, per layer type for Gemma 3), ``rope_scaling`` or the top level
    (transformers 4: ``rope_local_base_freq``)."""
    params = data.get("rope_parameters") or data.get("rope_scaling")
    theta = local = None
    if isinstance(params, dict) and "full_attention" in params:
        theta = _default_rope(model_type, params["full_attention"], "['full_attention']")
        if "sliding_attention" in params:
            where = "['sliding_attention']"
            local = _default_rope(model_type, params["sliding_attention"], where)
    elif params is not None:
        theta = _default_rope(model_type, params)
    if data.get("partial_rotary_factor", 1.0) != 1.0:
        _default_rope(model_type, {"partial_rotary_factor": data["partial_rotary_factor"]})
    if theta is None:
        theta = data.get("rope_theta", HF_DEFAULT_ROPE_THETA)
    if local is None and model_type == "gemma3_text":
        local = data.get("rope_local_base_freq")
    return theta, local


def _layer_types(model_type: str, data: dict) -> dict:
    """sliding_window and layer_types: Gemma's mix, Mistral's and Phi-3's window on every
    layer; Qwen2/3's and SmolLM3's ``use_sliding_window`` (its own layer rule) is refused."""
    window = data.get("sliding_window")
    if data.get("use_sliding_window", False):
        raise DiffulexEdgeError(f"{model_type} config sets use_sliding_window; not implemented")
    if model_type in ("gemma2", "gemma3_text"):
        types = data.get("layer_types")
        if types is None:  # transformers 4: every pattern-th layer is full, the rest slide
            pattern = data.get("sliding_window_pattern") or data.get("_sliding_window_pattern")
            pattern = pattern or 2  # Gemma 2 alternates; Gemma 3 configs carry theirs (6)
            types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(data["num_hidden_layers"])
            ]
        if "sliding_attention" not in types:
            window = None
        return {"sliding_window": window, "layer_types": list(types)}
    if model_type in ("mistral", "phi3") and window is not None:
        return {
            "sliding_window": window,
            "layer_types": ["sliding_attention"] * data["num_hidden_layers"],
        }
    return {}


def _family_switches(model_type: str, data: dict) -> dict:
    out: dict = {}
    if model_type in ("gemma2", "gemma3_text"):
        if data.get("use_bidirectional_attention"):
            raise DiffulexEdgeError(
                f"{model_type} config sets use_bidirectional_attention; only causal "
                "attention is implemented"
            )
        out["embedding_multiplier"] = data["hidden_size"] ** 0.5
        scalar = data.get("query_pre_attn_scalar")
        if scalar is not None:
            out["attention_scale"] = scalar**-0.5
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if data.get(key) is not None:
                out[key] = data[key]
    if model_type == "granite":
        out["embedding_multiplier"] = data.get("embedding_multiplier", 1.0)
        out["residual_multiplier"] = data.get("residual_multiplier", 1.0)
        out["logits_scaling"] = data.get("logits_scaling", 1.0)
        out["attention_scale"] = data.get("attention_multiplier", 1.0)
    if model_type == "smollm3" and data.get("no_rope_layers") is not None:
        out["rope_layers"] = list(data["no_rope_layers"])
    return out


def sdar_dict_from_hf(data: dict) -> dict:
    """The :class:`~diffulex_edge.config.SDARConfig` fields of a Hugging Face config dict.

    Raises :class:`DiffulexEdgeError` naming the model type or the field this model cannot
    honour.
    """
    model_type = data.get("model_type")
    if model_type not in ARCHITECTURES:
        raise DiffulexEdgeError(
            f"model_type {model_type!r} is not supported; expected 'sdar' or one of "
            f"{sorted(ARCHITECTURES)}"
        )
    want = _ACTIVATIONS.get(model_type, "silu")
    act = data.get("hidden_activation") or data.get("hidden_act") or want
    if act != want:
        raise DiffulexEdgeError(
            f"{model_type} config has hidden_act {act!r}; the {model_type} MLP here gates "
            f"with {want!r}"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if data.get(flag, False) and not (model_type == "qwen2" and flag == "attention_bias"):
            raise DiffulexEdgeError(
                f"{model_type} config sets {flag}: biases on "
                f"{'the o projection' if flag == 'attention_bias' else 'the MLP'} are not "
                "implemented"
            )
    out = {k: data[k] for k in _COPIED if k in data}
    # Llama's head_dim may be written as null (derived); SDARConfig derives it the same way.
    if out.get("head_dim") is None:
        out.pop("head_dim", None)
    out["tie_word_embeddings"] = data.get("tie_word_embeddings", False)
    out["rope_theta"], local = _rope_thetas(model_type, data)
    if local is not None:
        out["rope_local_theta"] = local
    out["hidden_act"] = act
    out.update(_layer_types(model_type, data))
    out.update(_family_switches(model_type, data))
    out.update(ARCHITECTURES[model_type])
    if "sliding_attention" not in (out.get("layer_types") or ()):
        out.pop("rope_local_theta", None)
    return out
