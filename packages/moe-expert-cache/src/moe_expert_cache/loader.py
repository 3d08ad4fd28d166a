"""Build an mlx-lm model whose MoE blocks run from a lazily loaded expert cache."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU

from moe_expert_cache.cached_layers import PredictiveCachedSwitchLinear, check_projection
from moe_expert_cache.config import CacheConfig
from moe_expert_cache.expert_store import PROJECTIONS, ExpertStore
from moe_expert_cache.layer_cache import LayerCache
from moe_expert_cache.manager import ExpertCacheManager
from moe_expert_cache.moe_blocks import BLOCKS, block_top_k
from moe_expert_cache.policies import make_policy
from moe_expert_cache.slots import ExpertSlots

MOE_ATTRS = ("mlp", "block_sparse_moe")


@dataclass
class CachedModel:
    """The patched mlx-lm ``model``, its cache ``manager``, the ``store`` and ``config.json``."""

    model: nn.Module
    manager: ExpertCacheManager
    store: ExpertStore
    model_config: dict


def find_moe_blocks(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(decoder layer, attribute, module path)`` of every block with a ``switch_mlp``."""
    paths = {id(m): name for name, m in model.named_modules()}
    found = []
    for layer in getattr(model, "layers", []):
        for attr in MOE_ATTRS:
            block = getattr(layer, attr, None) if attr in layer else None
            if isinstance(block, nn.Module) and "switch_mlp" in block:
                found.append((layer, attr, f"{paths[id(layer)]}.{attr}"))
    return found


def _model_classes(config: dict):
    model_type = config.get("model_type")
    try:
        arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"model_type {model_type!r} is not an mlx-lm architecture") from e
    return arch.Model, arch.ModelArgs


def patch_model(model: nn.Module, store: ExpertStore, config: CacheConfig) -> ExpertCacheManager:
    """Replace every MoE block of ``model`` with its cached version and fill the caches."""
    found = find_moe_blocks(model)
    if not found:
        raise ValueError(
            f"{type(model).__module__} has no MoE layers "
            f"(no layer.mlp.switch_mlp or layer.block_sparse_moe.switch_mlp)"
        )
    blocks = [getattr(layer, attr) for layer, attr, _ in found]
    for block, (_, _, path) in zip(blocks, found, strict=True):
        if type(block) not in BLOCKS:
            names = sorted(c.__name__ for c in BLOCKS)
            raise ValueError(f"{path}: MoE block {type(block).__name__} is not one of {names}")
        if not isinstance(block.switch_mlp, SwitchGLU):
            raise ValueError(
                f"{path}: switch_mlp is {type(block.switch_mlp).__name__}, not SwitchGLU"
            )
        if path not in store.blocks:
            raise ValueError(f"{path}: no stacked expert tensors in {store.model_dir}")
        for proj in PROJECTIONS:
            check_projection(getattr(block.switch_mlp, proj), store.blocks[path][proj])
    sizes = [store.num_experts(path) for _, _, path in found]
    top_k = block_top_k(blocks[0])
    capacities = config.layer_capacities(sizes, top_k)
    # Every check (capacities, pins, warm-start lists) passes before the model changes.
    all_slots = [
        ExpertSlots(sizes[i], capacities[i], top_k, config.pinned.get(i, ()), config.initial.get(i))
        for i in range(len(found))
    ]
    layers: list[LayerCache] = []
    for i, ((layer, attr, path), block) in enumerate(zip(found, blocks, strict=True)):
        policy = make_policy(config.policy, sizes[i])
        cache = LayerCache(i, path, store, all_slots[i], policy, config.mode == "skip")
        rows = cache.read_resident()
        for proj in PROJECTIONS:
            module = PredictiveCachedSwitchLinear(getattr(block.switch_mlp, proj), rows[proj])
            setattr(block.switch_mlp, proj, module)
            cache.projections[proj] = module
        setattr(layer, attr, BLOCKS[type(block)](block, cache))
        layers.append(cache)
    return ExpertCacheManager(layers, config, top_k)


def load_cached_model(model_dir: str | Path, config: CacheConfig | None = None) -> CachedModel:
    """Load ``model_dir`` (mlx-lm layout: ``config.json`` + ``model*.safetensors``) with
    only ``config.capacity`` experts per MoE layer resident.

    Non-expert weights are read and materialised; expert tensors are read one expert at a
    time by byte range. Raises ``FileNotFoundError`` for a missing directory or shard and
    ``ValueError`` for a truncated shard, a model without MoE layers or a bad capacity.
    """
    config = config or CacheConfig()
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    model_config = json.loads(cfg_path.read_text())
    model_class, args_class = _model_classes(model_config)
    store = ExpertStore(model_dir)
    # Built lazily: the stock random expert tables are replaced before anything evaluates them.
    model = model_class(args_class.from_dict(model_config))
    weights = store.non_expert_weights()
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantization = model_config.get("quantization")
    if quantization is not None:
        expert_quantized = {
            f"{block}.switch_mlp.{proj}"
            for block, projs in store.blocks.items()
            for proj, params in projs.items()
            if "scales" in params
        }
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode=quantization.get("mode", "affine"),
            class_predicate=lambda p, m: (
                hasattr(m, "to_quantized") and (f"{p}.scales" in weights or p in expert_quantized)
            ),
        )
    manager = patch_model(model, store, config)
    expert_prefixes = tuple(f"{layer.block_path}.switch_mlp." for layer in manager.layers)
    expected = {
        name for name, _ in tree_flatten(model.parameters()) if not name.startswith(expert_prefixes)
    }
    missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or extra:
        raise ValueError(f"{model_dir}: weights missing {missing[:5]}, unexpected {extra[:5]}")
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    model.eval()
    return CachedModel(model, manager, store, model_config)
