"""Hugging Face Llama-family configs (``llama``, ``qwen2``, ``qwen3``) as SDAR configs.

The three share SDAR's transformer: RMSNorm, RoPE, GQA and SwiGLU under the same tensor
names. They differ in switches: Qwen3 (and SDAR) normalise each query and key head
(``qk_norm``), Qwen2 adds biases to the q/k/v projections (``qkv_bias``), Llama has
neither. A feature this model does not implement (RoPE scaling, sliding windows, biases on
other projections, another activation) is refused by name rather than computed wrongly.
"""

from __future__ import annotations

from diffulex_edge.errors import DiffulexEdgeError

# model_type -> the switches its architecture fixes.
ARCHITECTURES = {
    "llama": {"qk_norm": False, "qkv_bias": False},
    "qwen2": {"qk_norm": False, "qkv_bias": True},
    "qwen3": {"qk_norm": True, "qkv_bias": False},
}
# transformers' own default when a config.json leaves rope_theta out (all three classes).
HF_DEFAULT_ROPE_THETA = 10000.0
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


def _rope_theta(model_type: str, data: dict):
    """rope_theta from ``rope_parameters`` (transformers 5), ``rope_scaling`` or the top
    level (transformers 4); only the default (unscaled) RoPE is implemented."""
    params = data.get("rope_parameters") or data.get("rope_scaling")
    if params is not None:
        if not isinstance(params, dict):
            raise DiffulexEdgeError(f"rope_parameters must be an object, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise DiffulexEdgeError(
                f"{model_type} config uses rope_type {kind!r}; only the default (unscaled) "
                "RoPE is implemented"
            )
        if "rope_theta" in params:
            return params["rope_theta"]
    return data.get("rope_theta", HF_DEFAULT_ROPE_THETA)


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
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise DiffulexEdgeError(f"{model_type} config has hidden_act {act!r}; SwiGLU needs 'silu'")
    for flag in ("attention_bias", "mlp_bias"):
        if data.get(flag, False) and not (model_type == "qwen2" and flag == "attention_bias"):
            raise DiffulexEdgeError(
                f"{model_type} config sets {flag}: biases on "
                f"{'the o projection' if flag == 'attention_bias' else 'the MLP'} are not "
                "implemented"
            )
    if data.get("use_sliding_window", False):
        raise DiffulexEdgeError(f"{model_type} config sets use_sliding_window; not implemented")
    out = {k: data[k] for k in _COPIED if k in data}
    # Llama's head_dim may be written as null (derived); SDARConfig derives it the same way.
    if out.get("head_dim") is None:
        out.pop("head_dim", None)
    out["tie_word_embeddings"] = data.get("tie_word_embeddings", False)
    out["rope_theta"] = _rope_theta(model_type, data)
    out.update(ARCHITECTURES[model_type])
    return out
