"""Build an mlx-lm model whose MoE blocks run from a lazily loaded expert cache."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU

from moe_expert_cache.block_registry import BLOCKS, supported_model_types
from moe_expert_cache.cached_layers import check_projection, cut_to_slots
from moe_expert_cache.config import ExpertCacheConfig
from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.expert_store import PROJECTIONS, ExpertStore
from moe_expert_cache.layer_cache import LayerCache
from moe_expert_cache.manager import ExpertCacheManager
from moe_expert_cache.mapped_embedding import EMBEDDING_KEY, map_embedding
from moe_expert_cache.model_config import read_model_config
from moe_expert_cache.moe_blocks import block_top_k
from moe_expert_cache.policies import make_policy
from moe_expert_cache.prefetch import SpeculativePrefetch, check_decoder_layer
from moe_expert_cache.safetensors_io import FLOAT_DTYPES, TensorInfo
from moe_expert_cache.slots import ExpertSlots

MOE_ATTRS = ("mlp", "block_sparse_moe")
SWITCH_ATTRS = ("switch_mlp", "experts")


@dataclass
class CachedModel:
    """What :func:`load_cached_model` returns.

    Attributes:
        model: The mlx-lm model with its MoE blocks replaced by cached ones; drive it with
            ``mlx_lm.generate`` or :func:`moe_expert_cache.generate`.
        manager: The cache manager: metrics, state, traces, between-token updates.
        store: The expert store reading the checkpoint's shards.
        model_config: The checkpoint's ``config.json``, checked.
    """

    model: nn.Module
    manager: ExpertCacheManager
    store: ExpertStore
    model_config: dict


def find_moe_blocks(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(decoder layer, attribute, module path)`` of every block with a ``switch_mlp``
    (or, as GPT-OSS names it, ``experts``) module."""
    paths = {id(m): name for name, m in model.named_modules()}
    found = []
    for layer in getattr(model, "layers", []):
        for attr in MOE_ATTRS:
            block = getattr(layer, attr, None) if attr in layer else None
            if isinstance(block, nn.Module) and any(
                isinstance(block.get(name), nn.Module) for name in SWITCH_ATTRS
            ):
                found.append((layer, attr, f"{paths[id(layer)]}.{attr}"))
    return found


def _model_classes(config: dict):
    model_type = config.get("model_type")
    try:
        arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ExpertCacheError(f"model_type {model_type!r} is not an mlx-lm architecture") from e
    return arch.Model, arch.ModelArgs


def _check_expert_shapes(stock: nn.Module, infos: dict[str, TensorInfo], where: str) -> None:
    """The checkpoint's stacked expert tensors have the stock projection's shapes and kinds."""
    params = dict(tree_flatten(stock.parameters()))
    if set(params) != set(infos):
        raise ExpertCacheError(
            f"{where}: the checkpoint has {sorted(infos)}, the model expects {sorted(params)}"
        )
    for name, param in params.items():
        info = infos[name]
        if info.shape != tuple(param.shape) or (info.dtype in FLOAT_DTYPES) != _is_float(param):
            raise ExpertCacheError(
                f"{info.shard}: expert tensor {info.name!r} is {info.dtype} {list(info.shape)}, "
                f"expected {'a float' if _is_float(param) else 'an integer'} tensor of shape "
                f"{list(param.shape)} for this config.json"
            )


def patch_model(
    model: nn.Module, store: ExpertStore, config: ExpertCacheConfig
) -> ExpertCacheManager:
    """Replace every MoE block of ``model`` with its cached version and fill the caches."""
    found = find_moe_blocks(model)
    if not found:
        raise ExpertCacheError(
            f"{type(model).__module__} has no MoE layers "
            f"(no layer.mlp.switch_mlp, layer.mlp.experts or layer.block_sparse_moe.switch_mlp)"
        )
    blocks = [getattr(layer, attr) for layer, attr, _ in found]
    for block, (layer, _, path) in zip(blocks, found, strict=True):
        if type(block) not in BLOCKS:
            names = sorted(c.__name__ for c in BLOCKS)
            raise ExpertCacheError(
                f"{path}: MoE block {type(block).__name__} is not one of {names}"
            )
        if getattr(block, "sharding_group", None) is not None:
            raise ExpertCacheError(
                f"{path}: sharded (distributed) {type(block).__name__} blocks are not supported"
            )
        switch_attr = BLOCKS[type(block)].switch_attr
        switch = getattr(block, switch_attr)
        if not isinstance(switch, SwitchGLU):
            raise ExpertCacheError(
                f"{path}: {switch_attr} is {type(switch).__name__}, not SwitchGLU"
            )
        if path not in store.blocks:
            raise ExpertCacheError(f"{path}: no stacked expert tensors in {store.model_dir}")
        if store.switch_names[path] != switch_attr:
            raise ExpertCacheError(
                f"{path}: the checkpoint's experts are under {store.switch_names[path]}, "
                f"{type(block).__name__} keeps them in {switch_attr}"
            )
        if config.prefetch:
            check_decoder_layer(layer)
        for proj in PROJECTIONS:
            stock = getattr(switch, proj)
            check_projection(stock, store.blocks[path][proj])
            _check_expert_shapes(stock, store.blocks[path][proj], f"{path}.{switch_attr}.{proj}")
    sizes = [store.num_experts(path) for _, _, path in found]
    top_k = block_top_k(blocks[0])
    capacities = config.layer_capacities(sizes, top_k)
    # Every check (capacities, pins, warm-start lists) passes before the model changes.
    all_slots = [
        ExpertSlots(sizes[i], capacities[i], top_k, config.pinned.get(i, ()), config.initial.get(i))
        for i in range(len(found))
    ]
    layers: list[LayerCache] = []
    prefetch = SpeculativePrefetch() if config.prefetch else None
    for i, ((layer, attr, path), block) in enumerate(zip(found, blocks, strict=True)):
        policy = make_policy(config.policy, sizes[i])
        cache = LayerCache(i, path, store, all_slots[i], policy, config.mode == "skip")
        rows = cache.read_resident()
        switch = getattr(block, BLOCKS[type(block)].switch_attr)
        for proj in PROJECTIONS:
            cache.projections[proj] = cut_to_slots(getattr(switch, proj), rows[proj])
        cached_block = BLOCKS[type(block)](block, cache)
        setattr(layer, attr, cached_block)
        if prefetch is not None and i > 0:  # the first MoE layer has no previous output
            prefetch.add(i, layer, cached_block)
        layers.append(cache)
    vocab_size = getattr(getattr(model, "args", None), "vocab_size", None)
    manager = ExpertCacheManager(layers, config, top_k, vocab_size, prefetch)
    _begin_each_forward_with(model, manager)
    return manager


_HOOKED_CLASSES: dict[type, type] = {}


def _begin_each_forward_with(model: nn.Module, manager: ExpertCacheManager) -> None:
    """Give ``model`` a subclass of its own class whose ``__call__`` first runs
    ``manager.begin_forward``: the token ids are checked and the pending between-token
    update runs, whoever calls the model (``mlx_lm.generate``, ``stream_generate``, a
    server, your own loop). Python looks ``__call__`` up on the type, so the class is the
    one place to put it; the subclass keeps the stock module name, which mlx-lm reads.
    """
    stock = type(model)
    if stock not in _HOOKED_CLASSES:

        def __call__(self, inputs, *args, **kwargs):
            embedded = kwargs.get("input_embeddings") is not None or (
                len(args) > 1 and args[1] is not None
            )
            self.expert_cache_manager.begin_forward(None if embedded else inputs)
            return stock.__call__(self, inputs, *args, **kwargs)

        name = f"ExpertCached{stock.__name__}"
        _HOOKED_CLASSES[stock] = type(
            name, (stock,), {"__call__": __call__, "__module__": stock.__module__}
        )
    model.__class__ = _HOOKED_CLASSES[stock]
    model.expert_cache_manager = manager


def _check_weights(model: nn.Module, weights: dict[str, mx.array], skip: tuple, where) -> None:
    """Every non-expert parameter of ``model`` has a tensor of its shape and kind (float or
    integer) in ``weights``, and ``weights`` holds nothing else."""
    params = {n: p for n, p in tree_flatten(model.parameters()) if not n.startswith(skip)}
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or extra:
        raise ExpertCacheError(f"{where}: weights missing {missing[:5]}, unexpected {extra[:5]}")
    for name, param in params.items():
        w = weights[name]
        if w.shape != param.shape or _is_float(w) != _is_float(param):
            raise ExpertCacheError(
                f"{where}: tensor {name!r} is {w.dtype} {tuple(w.shape)}, expected "
                f"{'a float' if _is_float(param) else 'an integer'} tensor of shape "
                f"{tuple(param.shape)} for this config.json"
            )


def _is_float(a: mx.array) -> bool:
    return mx.issubdtype(a.dtype, mx.floating)


def load_cached_model(
    model_dir: str | Path, config: ExpertCacheConfig | None = None
) -> CachedModel:
    """Load an mlx-lm MoE checkpoint with only some experts per MoE layer resident.

    Non-expert weights are read and materialised (except the input embedding table with
    ``config.map_embeddings``, which stays in the shard's memory map); expert tensors are
    read one expert at a time by byte range.

    Args:
        model_dir: The checkpoint directory, mlx-lm layout: ``config.json``,
            ``model*.safetensors`` (and the index when sharded).
        config: The cache's settings (default ``ExpertCacheConfig()``: half of each
            layer's experts resident, exact mode).

    Returns:
        The cached model, its manager, store and config.

    Raises:
        FileNotFoundError: No ``config.json`` in ``model_dir``, or a shard missing
            (:class:`MissingShardError`, also an :class:`ExpertCacheError`).
        ExpertCacheError: A damaged or inconsistent shard or ``config.json``, an
            unsupported model type, a model without MoE layers or a capacity that does
            not fit; a ``ValueError``.
    """
    config = config or ExpertCacheConfig()
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    store = ExpertStore(model_dir)
    try:
        return _load(model_dir, cfg_path, store, config)
    except BaseException:
        store.close()
        raise


def _load(model_dir: Path, cfg_path: Path, store: ExpertStore, config: ExpertCacheConfig):
    data = cfg_path.read_bytes()
    store.check_file("config.json", data)
    model_config = read_model_config(cfg_path, data, supported_model_types(), store._infos)
    model_class, args_class = _model_classes(model_config)
    # Built lazily: the stock random expert tables are replaced before anything evaluates them.
    try:
        model = model_class(args_class.from_dict(model_config))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
        raise ExpertCacheError(
            f"{cfg_path}: mlx-lm cannot build a {model_config['model_type']} model from it: "
            f"{type(e).__name__}: {e}"
        ) from e
    mapped = ()
    if config.map_embeddings:  # before the reads: the table is never read whole
        map_embedding(model, store)
        mapped = (EMBEDDING_KEY,)
    weights = store.non_expert_weights(skip=mapped)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantization = model_config.get("quantization")
    if quantization is not None:
        expert_quantized = {
            f"{block}.{store.switch_names[block]}.{proj}"
            for block, projs in store.blocks.items()
            for proj, params in projs.items()
            if "scales" in params
        }
        # Per-layer settings (a dict under the module's path) win, as in mlx-lm's loader.
        per_layer = {k: v for k, v in quantization.items() if isinstance(v, dict)}
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode=quantization.get("mode", "affine"),
            class_predicate=lambda p, m: (
                hasattr(m, "to_quantized")
                and (f"{p}.scales" in weights or p in expert_quantized)
                and (
                    per_layer[p]
                    if p in per_layer
                    else m.weight.shape[-1] % quantization["group_size"] == 0
                )
            ),
        )
    manager = patch_model(model, store, config)
    expert_prefixes = tuple(
        f"{layer.block_path}.{store.switch_names[layer.block_path]}." for layer in manager.layers
    )
    _check_weights(model, weights, expert_prefixes, model_dir)
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    model.eval()
    return CachedModel(model, manager, store, model_config)
