"""``config.json`` of an mlx-lm MoE checkpoint: read strictly and checked against its shards.

Checked before mlx-lm builds anything from it: the model type is one whose MoE block this
package serves, sizes are integers in range (``num_hidden_layers`` must equal the layers
the shards hold: mlx-lm builds one module per layer), flags are booleans, and
``quantization`` holds a group size and bit width that MLX supports for its mode.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from moe_expert_cache.checked_json import is_int, loads_strict
from moe_expert_cache.errors import ExpertCacheError

_MAX_SIZE = 2**24
INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_experts_per_tok",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "moe_layer_freq",
    "head_dim",
    "max_position_embeddings",
    "decoder_sparse_step",
)
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "attention_bias", "mlp_bias")
# mode -> (group sizes, bits) that mx.quantize accepts.
QUANT_MODES = {
    "affine": ((32, 64, 128), (2, 3, 4, 5, 6, 8)),
    "mxfp4": ((32,), (4,)),
    "mxfp8": ((32,), (8,)),
    "nvfp4": ((16,), (4,)),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def read_model_config(path: Path, data: bytes, model_types, tensor_names) -> dict:
    """``config.json`` (its ``data``) parsed and checked; ``model_types``: the supported
    ``model_type`` values; ``tensor_names``: every tensor name in the shards."""
    cfg = loads_strict(data, str(path))
    if not isinstance(cfg, dict):
        raise ExpertCacheError(f"{path}: expected a JSON object")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in model_types:
        raise ExpertCacheError(
            f"{path}: model_type {model_type!r} has no MoE layers this package can page: "
            "no cached block mirrors its router and expert layout\n"
            f"expected one of {sorted(model_types)}"
        )
    for name in INT_FIELDS:
        if name in cfg and not (is_int(cfg[name]) and 1 <= cfg[name] <= _MAX_SIZE):
            raise ExpertCacheError(
                f"{path}: {name} = {cfg[name]!r}, expected an integer in [1, {_MAX_SIZE}]"
            )
    for name in POSITIVE_FLOAT_FIELDS:
        v = cfg.get(name)
        if name in cfg and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf
        ):
            raise ExpertCacheError(f"{path}: {name} = {v!r}, expected a finite number > 0")
    for name in BOOL_FIELDS:
        if name in cfg and not isinstance(cfg[name], bool):
            raise ExpertCacheError(f"{path}: {name} = {cfg[name]!r}, expected true or false")
    layers = {int(m[1]) for m in map(_LAYER.match, tensor_names) if m}
    n = cfg.get("num_hidden_layers")
    if layers != set(range(n if is_int(n) else -1)):
        raise ExpertCacheError(
            f"{path}: num_hidden_layers = {n!r}, the shards hold layers "
            f"{_ranges(sorted(layers))}; expected layers 0 .. num_hidden_layers - 1"
        )
    if "mlp_only_layers" in cfg:
        v = cfg["mlp_only_layers"]
        if not isinstance(v, list) or not all(is_int(i) and 0 <= i < n for i in v):
            raise ExpertCacheError(
                f"{path}: mlp_only_layers = {v!r}, expected a list of layer numbers < {n}"
            )
    if cfg.get("quantization") is not None:
        check_quantization(path, cfg["quantization"])
    return cfg


def check_quantization(path: Path, q) -> None:
    """``{"group_size", "bits", "mode"?, <module path>: {...}?}``: the default settings,
    and per-layer settings as ``mlx_lm.convert`` writes them (e.g. Qwen3-MoE's and
    GPT-OSS's 8-bit routers), each with values ``mx.quantize`` accepts."""
    if not isinstance(q, dict) or not {"group_size", "bits"} <= set(q):
        raise ExpertCacheError(f"{path}: quantization = {q!r}, expected group_size and bits")
    _check_quant_settings(path, "quantization", {k: v for k, v in q.items() if k in _SETTINGS})
    for layer, settings in q.items():
        if layer in _SETTINGS:
            continue
        if (
            not isinstance(settings, dict)
            or not {"group_size", "bits"} <= set(settings)
            or not set(settings) <= set(_SETTINGS)
        ):
            raise ExpertCacheError(
                f"{path}: quantization[{layer!r}] = {settings!r}, expected a layer's "
                "group_size, bits and optional mode"
            )
        _check_quant_settings(path, f"quantization[{layer!r}]", settings)


_SETTINGS = ("group_size", "bits", "mode")


def _check_quant_settings(path: Path, where: str, q: dict) -> None:
    mode = q.get("mode", "affine")
    if not isinstance(mode, str) or mode not in QUANT_MODES:
        raise ExpertCacheError(
            f"{path}: {where} mode {mode!r}, expected one of {sorted(QUANT_MODES)}"
        )
    group_sizes, bits = QUANT_MODES[mode]
    for name, allowed in (("group_size", group_sizes), ("bits", bits)):
        v = q[name]
        if not is_int(v) or v not in allowed:
            raise ExpertCacheError(
                f"{path}: {where} {name} = {v!r}, expected one of {list(allowed)} for mode {mode!r}"
            )


def _ranges(numbers: list[int]) -> str:
    if not numbers:
        return "none"
    if numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]} .. {numbers[-1]}"
    return str(numbers[:8])
