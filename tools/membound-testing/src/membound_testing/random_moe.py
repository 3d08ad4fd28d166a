"""Random MoE checkpoints built from mlx-lm's own model classes, for moe-expert-cache's
tests, benchmarks and the integration tests (moved here from the installed package).

Written in mlx-lm's layout (``config.json``, sharded ``model-0000i-of-0000n.safetensors``,
``model.safetensors.index.json``) so that both ``mlx_lm.utils.load_model`` and
:func:`moe_expert_cache.load_cached_model` read it. MLX and mlx-lm are imported inside
:func:`write_random_moe`: every dev environment installs this helper package, only
moe-expert-cache's have MLX. moe-expert-cache itself is never imported here: the caller
passes its ``seal_model``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def random_moe_config(
    model_type: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    expert_size: int = 128,
    vocab_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> dict:
    """An mlx-lm ``config.json`` for a small ``model_type`` MoE (every layer sparse)."""
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {ARCHITECTURES}, got {model_type!r}")
    common = {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_experts_per_tok": top_k,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if model_type == "mixtral":
        return {**common, "intermediate_size": expert_size, "num_local_experts": num_experts}
    common["num_experts"] = num_experts
    if model_type == "qwen2_moe":
        return {
            **common,
            "intermediate_size": expert_size,
            "moe_intermediate_size": expert_size,
            "shared_expert_intermediate_size": expert_size,
        }
    if model_type == "qwen3_moe":
        return {
            **common,
            "intermediate_size": expert_size,
            "moe_intermediate_size": expert_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "head_dim": hidden_size // num_heads,
            "max_position_embeddings": 4096,
            "norm_topk_prob": True,
        }
    return {**common, "intermediate_size": expert_size, "norm_topk_prob": False}


def write_random_moe(
    directory: str | Path,
    config: dict,
    *,
    seal: Callable[[Path], object],
    bits: int | None = None,
    group_size: int = 64,
    shards: int = 2,
    seed: int = 0,
    dtype=None,
) -> Path:
    """Build ``config``'s model with random weights of the MLX ``dtype`` (float32 when None;
    ``bits``-bit affine quantized when given) and save it to ``directory`` as ``shards``
    safetensors files, then call ``seal(directory)``: moe-expert-cache's ``seal_model``,
    which writes its integrity record (passed in, so that this helper imports no package
    of the repo)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    if config.get("model_type") not in ARCHITECTURES:
        raise ValueError(
            f"model_type must be one of {ARCHITECTURES}, got {config.get('model_type')!r}"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32 if dtype is None else dtype)
    config = dict(config)
    if bits is not None:
        nn.quantize(
            model,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda _, m: (
                hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
            ),
        )
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    weights = dict(tree_flatten(model.parameters()))
    total = sum(w.nbytes for w in weights.values())
    groups: list[dict[str, mx.array]] = [{} for _ in range(shards)]
    seen = 0
    for name in sorted(weights):
        # Fill shards in order by size, so a stacked expert tensor never spans two files.
        groups[min(shards - 1, seen * shards // total)][name] = weights[name]
        seen += weights[name].nbytes
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(directory / fname), group, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(group, fname))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    seal(directory)
    return directory
