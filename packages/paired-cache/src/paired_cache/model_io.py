"""Models on storage: read MLP weights for ``convert``, and build a sparse model with
``load_sparse`` whose weights stay in their files (mapped read-only, file-backed pages).

``convert`` reads a Hugging Face directory (config.json and *.safetensors), a single
.safetensors file, or a GGUF file (dequantised by transformers, which needs ``gguf``), and
writes every gated MLP's neuron pool (paired_cache.pool_file). ``load_sparse`` builds the
transformers model on the meta device, replaces each MLP by a SparseMLP over its pool in the
pool file, and points every other parameter at its bytes in the mapped safetensors: the
dense MLP weights are never materialised, and no weight becomes anonymous memory.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from paired_cache.compressed_mlp import CompressedSparseMLP
from paired_cache.compressed_pool import DEFAULT_LEVEL, check_level
from paired_cache.config import PairedCacheConfig
from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import active_rows
from paired_cache.mlp_layouts import activation, gated_weights, mlp_layout
from paired_cache.pool_file import PoolFile, umask_mode, write_pool_file
from paired_cache.read_ahead import attach_page_hooks
from paired_cache.registry import source_class
from paired_cache.safetensors_map import SafetensorsMap
from paired_cache.sparse_base import SAVE_REFUSED, CachedMLP, check_prefill, check_window
from paired_cache.sparse_mlp import (
    SparseMLP,
    check_in_place_window,
    check_rows,
    guard_sparse_model,
)
from paired_cache.trained_predictor import load_predictors

MLP_SUFFIXES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
# Phi-3's MLP: gate and up in one (2N, hidden) weight, the gate's rows first.
FUSED_SUFFIXES = ("gate_up_proj.weight", "down_proj.weight")


def _safetensors_files(source: Path) -> list[Path]:
    if source.is_file() and source.suffix == ".safetensors":
        return [source]
    if source.is_dir():
        files = sorted(source.glob("*.safetensors"))
        if files:
            return files
    raise PairedCacheError(
        f"{source}: expected a .safetensors file, a .gguf file or a directory holding *.safetensors"
    )


def _mlp_prefixes(names) -> list[str]:
    """'model.layers.0.mlp' for every gate_proj/up_proj/down_proj triple (or fused
    gate_up_proj/down_proj pair), in layer order."""
    prefixes = {
        n[: -len(first) - 1]
        for n in names
        for first in (MLP_SUFFIXES[0], FUSED_SUFFIXES[0])
        if n.endswith("." + first)
    }

    def key(prefix: str):
        return [int(p) if p.isdigit() else p for p in prefix.split(".")]

    return sorted(prefixes, key=key)


def iter_mlp_weights(source: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor, ...]]:
    """The weights of every gated MLP of a model on storage, in layer order.

    Args:
        source: a HF directory or .safetensors file (read through the mapping), or a
            .gguf file (loaded and dequantised by transformers, which needs ``gguf``).

    Returns:
        An iterator of (name, gate (N, hidden), up (N, hidden), down (hidden, N)), the
        tensors in the model's dtype; name as ``model.layers.0.mlp``.

    Raises:
        PairedCacheError: no safetensors, no gated MLP, or an MLP missing a weight.
    """
    source = Path(source)
    if source.suffix == ".gguf":
        yield from _gguf_mlp_weights(source)
        return
    maps = [SafetensorsMap(p) for p in _safetensors_files(source)]
    where = {name: m for m in maps for name in m.entries}
    prefixes = _mlp_prefixes(where)
    if not prefixes:
        # The first line names the family (a model directory's model_type) and what is
        # missing; the second, where and what to do instead.
        raise PairedCacheError(
            f"{_model_type(source) or source}: no gated MLP (gate_proj, up_proj and down_proj, "
            f"or Phi-3's gate_up_proj and down_proj), the layouts convert writes pools for\n"
            f"{source} has no '*.gate_proj.weight' or '*.gate_up_proj.weight' tensors; "
            f"non-gated fc1 / fc2 MLPs (GPT-NeoX, Phi-2, OPT) are sparsified in memory with "
            f"sparsify_model"
        )
    for prefix in prefixes:
        fused = f"{prefix}.{MLP_SUFFIXES[0]}" not in where
        names = [f"{prefix}.{s}" for s in (FUSED_SUFFIXES if fused else MLP_SUFFIXES)]
        missing = [n for n in names if n not in where]
        if missing:
            raise PairedCacheError(f"{source}: {prefix} lacks {missing}")
        tensors = [where[n].tensor(n) for n in names]
        if fused:
            gate_up, down = tensors
            n = gate_up.shape[0] // 2
            tensors = [gate_up[:n], gate_up[n:], down]  # row blocks: contiguous views
        yield (prefix, *tensors)


def _model_type(source: Path) -> str:
    """The model_type in the config.json of a model directory, else ''."""
    config = source / "config.json" if source.is_dir() else None
    if config is None or not config.is_file():
        return ""
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return ""
    return model_type if isinstance(model_type, str) else ""


def _gguf_mlp_weights(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    for name, module in model.named_modules():
        layout = mlp_layout(module)
        if layout is not None and layout.gated:
            yield (name, *gated_weights(module, layout))


class _Progress:
    """A one-line progress bar on stderr: [#####     ] 12/30 model.layers.11.mlp."""

    def __init__(self, total: int | None, stream=sys.stderr) -> None:
        self.total, self.done, self.stream = total, 0, stream

    def __call__(self, label: str) -> None:
        self.done += 1
        if self.total:
            filled = 30 * self.done // self.total
            bar = f"[{'#' * filled}{' ' * (30 - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done}"
        self.stream.write(f"\r{bar} {label}\x1b[K")
        if self.total and self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


CODECS = ("zstd", "grid")  # convert's compress, besides True (zstd) and False


def convert(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    gate: bool | None = None,
    progress: bool = True,
    compress: bool | str = False,
    compress_level: int = DEFAULT_LEVEL,
):
    """Write every gated MLP of the model at source into the pool file out. Nothing is
    left at out when it fails.

    Args:
        source: a HF directory, a .safetensors file or a .gguf file (iter_mlp_weights).
        out: the pool file to write.
        gate: False writes rows of up | down_T only (gate_cols 0): a third smaller for a
            SwiGLU MLP, for load_sparse with a mask source that computes act(gate x)
            itself ("cats", "trained" with the gated predictor) from gate_proj mapped
            from the model's safetensors; every row a token reads is then the bytes the
            kernel multiplies and nothing else. None (the default): True, or False with
            compress.
        progress: draw a progress bar on stderr.
        compress: write a compressed pool, which load_sparse reads in place
            (rows="in_place") with cats or the gated predictor, decoding a token's picked
            rows only. True or "zstd" (format 2): no gate, and each neuron's up | down_T
            row as one zstd frame. "grid" (format 3): no gate, and each row as the Q4_1 or
            Q8_0 codes its float32 weights were dequantized from (a GGUF's float copy),
            decoded bit for bit; a model whose MLP weights are not exactly on such a grid
            is refused by name, before anything is written.
        compress_level: the zstd level, in [1, 22] (unused by "grid").

    Returns:
        The pool file's layers: a PoolLayer list (CompressedLayer with compress).

    Raises:
        PairedCacheError: a bad argument, a missing source, or a model with no gated MLP.
    """
    if not (isinstance(compress, bool) or (isinstance(compress, str) and compress in CODECS)):
        raise PairedCacheError(f"compress must be False, True, 'zstd' or 'grid', got {compress!r}")
    check_level(compress_level)
    if gate is None:
        gate = not compress
    if not isinstance(gate, bool):
        raise PairedCacheError(f"gate must be a bool, got {gate!r}")
    if gate and compress:
        raise PairedCacheError(
            f"gate=True with compress={compress!r}: a compressed pool holds no gate (the mask source "
            "reads gate_proj from the safetensors); leave gate unset"
        )
    source = Path(source)
    if not source.exists():
        raise PairedCacheError(f"{source} does not exist")
    total = None
    if source.suffix != ".gguf":
        maps = [SafetensorsMap(p) for p in _safetensors_files(source)]
        total = len(_mlp_prefixes(name for m in maps for name in m.entries))
    bar = _Progress(total) if progress else None
    layers = iter_mlp_weights(source)
    if not gate:
        layers = ((name, g[:, :0], up, down) for name, g, up, down in layers)
    grid = compress == "grid"
    level = compress_level if compress and not grid else None
    return write_pool_file(out, layers, progress=bar, compress_level=level, grid=grid)


def save_dense(model: nn.Module, directory: str | os.PathLike, tokenizer=None) -> Path:
    """Write a dense transformers model as the directory convert and load_sparse read:
    config.json, model.safetensors (the model's own dtype) and, when given, the tokenizer.

    Unlike save_pretrained it takes a model loaded from a GGUF (whose weights are plain
    float tensors once transformers dequantised them; save_pretrained refuses it). Written
    to a temporary directory beside `directory` and renamed: a failure leaves nothing there.

    Args:
        model: a dense transformers model (not sparsified).
        directory: where to write; must not exist, or be empty.
        tokenizer: a tokenizer to save beside it, or None.

    Returns:
        The directory, as a Path.

    Raises:
        PairedCacheError: a sparsified model, or a directory that exists and is not empty.
    """
    import shutil
    import tempfile

    from safetensors.torch import save_model

    if any(isinstance(m, CachedMLP) for m in model.modules()):
        raise PairedCacheError(f"save_dense: {SAVE_REFUSED}")
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise PairedCacheError(f"{directory} already exists; save_dense writes a new directory")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", suffix=".tmp", dir=directory.parent))
    try:
        # save_model drops the tied lm_head duplicate; from_pretrained ties it again.
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # the GGUF's: the weights are float now
            del config.quantization_config
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():  # safetensors writes 0600
            os.chmod(f, umask_mode())
        os.chmod(tmp, umask_mode(0o777))  # mkdtemp made it 0700
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


@dataclass
class LoadConfig:
    """load_sparse's options, checked before anything is read (its arguments, as it takes
    them; see load_sparse for what each means). A bad value raises PairedCacheError naming
    it and what was expected.

    rows: "in_place" (each token's rows multiplied where they lie in the mapped pool, no
    active rows kept; window 1) or "copy" (the paired-replacement cache of active rows,
    anonymous memory; any window): SparseMLP.from_pool_file. None (the default) resolves
    to "in_place" for window 1 and "copy" for a larger window. In place is faster and fits
    a lower hard limit (README, "Under a hard memory limit").

    prefill: "dense" (the default: a prompt's MLPs over every row at once, exact; decoding
    stays sparse) or "sparse" (a prompt's tokens each with its own mask, as decoding):
    SparseMLP.prefill.

    read_ahead: the safetensors are mapped ``MADV_RANDOM`` and, as each decoder layer
    starts, the kernel is asked (``MADV_WILLNEED``) for the mapped tensors the next one
    reads in full (attention, the gate the mask source scores with; after the last layer
    the lm_head, after the lm_head the first layer's), and with ``rows="in_place"`` for
    the next layer's whole pool where keep_cached keeps it; ranges that look cached are
    skipped (see read_ahead.add_read_ahead). The next layer's reads overlap this one's
    compute, and nothing else in the file is read ahead with them. False: no read-ahead
    hooks, the device's default read-ahead.

    keep_cached: how many bytes of what each token reads in full from the mappings (the
    ranges read_ahead asks for: attention, the gate, the lm_head, in place the pools) stay
    in the page cache from one token to the next. A token reads them in the same order
    every time; once they outgrow the page cache, the kernel's LRU evicts each page before
    its next use, and every token reads all of them again. So some blocks are kept,
    largest first (SmolLM2: the lm_head, then the layers in reading order), and every
    other block's ranges are paged out (``MADV_PAGEOUT``) as soon as the block is done,
    so they do not evict the kept ones. "auto" (the default): as many as fit in the room
    the process's memory cgroup leaves for page cache (its hard limit minus what it holds
    besides file pages), beside the two largest consecutive blocks not kept (one being
    read, the next read ahead) and 4 MiB, decided again as each token starts; where no
    limit applies, nothing is paged out. An int: that many bytes. None: leave the page
    cache to the kernel. Nothing is pinned (no mlock): under a lower limit the kernel
    still evicts kept pages, so the smallest hard limit the model runs under does not
    move. In place, a layer whose pool is not kept has no whole-pool read-ahead: once the
    token's mask is known it asks for the pages of the picked rows only
    (``PoolFile.will_need_rows``; SmolLM2 at 50%: about 70% of the pool's pages). The
    model's ``page_keeper`` (a read_ahead.PageKeeper) says which blocks it kept at the
    last token. README, "Under a hard memory limit": what each of these saves under the
    budget runner's tight profile.

    options: the mask source's options; ``predictor`` (a path) is read by load_sparse.
    """

    source: str = "cats"
    fraction: float = 0.5
    config: PairedCacheConfig | None = None
    window: int = 1
    rows: str | None = None
    read_ahead: bool = True
    keep_cached: int | str | None = "auto"
    prefill: str = "dense"
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        source_class(self.source)
        active_rows(self.fraction, 1)
        check_window(self.window)
        check_prefill(self.prefill)
        if self.rows is None:
            self.rows = "in_place" if self.window == 1 else "copy"
        check_rows(self.rows)
        if self.rows == "in_place":
            check_in_place_window(self.window)
        if not isinstance(self.read_ahead, bool):
            raise PairedCacheError(f"read_ahead must be a bool, got {self.read_ahead!r}")
        keep = self.keep_cached
        if not (
            keep is None
            or keep == "auto"
            or (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 0)
        ):
            raise PairedCacheError(
                f"keep_cached must be 'auto', None or a byte count >= 0, got {keep!r}"
            )


def load_sparse(
    model_dir: str | os.PathLike,
    pool_path: str | os.PathLike,
    source: str = "cats",
    fraction: float = 0.5,
    *,
    config: PairedCacheConfig | None = None,
    window: int = 1,
    rows: str | None = None,
    read_ahead: bool = True,
    keep_cached: int | str | None = "auto",
    prefill: str = "dense",
    **options,
):
    """Build a transformers causal LM from storage whose MLPs are SparseMLPs over the pool
    file's mapped pools and whose other weights are views of the mapped safetensors of
    model_dir: nothing is copied into anonymous memory but the caches' active rows and
    what the mask sources build.

    Args:
        model_dir: a model directory, config.json and *.safetensors (save_dense writes one).
        pool_path: the pool file convert wrote from it, with or without the gate, or
            compressed (then rows="in_place" and a source that computes act(gate x)).
        source: a MASK_SOURCES name whose build needs no calibration inputs ("cats",
            "oracle", or "trained" with predictor=PATH, a file of save_predictors).
        fraction: the share of each MLP's rows a token reads, in (0, 1].
        config: the caches' PairedCacheConfig (None: its defaults).
        window: tokens whose masks' union stays resident, in [1, 1024].
        rows, read_ahead, keep_cached, prefill: where a token's rows are read from
            ("in_place" or "copy"), what is read ahead and what stays in the page cache,
            how a prompt's MLPs run; LoadConfig says what each value does.
        **options: the mask source's options; predictor=PATH for "trained".

    Returns:
        The model, in eval mode; with keep_cached, its ``page_keeper``.

    Raises:
        PairedCacheError: a bad argument (before anything is read), a missing model
            directory, a pool file or predictor file that does not match the model.
    """
    from transformers import AutoConfig

    load = LoadConfig(
        source, fraction, config, window, rows, read_ahead, keep_cached, prefill, options
    )
    model_dir = _model_dir(model_dir)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    pools = _open_pools(pool_path, load)
    where = _map_safetensors(model_dir, pools, pool_path, load.read_ahead)
    model, mlp_names = _meta_model(hf_config, pools, pool_path, model_dir)
    source_options = _source_options(load.options, mlp_names)
    used: set[str] = set()  # the mapped tensors the model reads
    for name in mlp_names:
        _put_sparse_mlp(model, name, pools, where, used, load, source_options)
    _map_parameters(model, where, used)
    _make_unsaved(model, hf_config)
    _check_all_mapped(model, model_dir)
    model.eval()
    guard_sparse_model(model)
    _attach_page_hooks(model, mlp_names, pools, where, used, load)
    return model


def _model_dir(model_dir: str | os.PathLike) -> Path:
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        # transformers would take a missing directory for a hub repo id and say so.
        what = "does not exist" if not model_dir.exists() else "holds no config.json"
        raise PairedCacheError(
            f"{model_dir} {what}: load_sparse needs a model directory (config.json and "
            f"*.safetensors; save a .gguf-loaded model there with save_pretrained)"
        )
    return model_dir


def _open_pools(pool_path: str | os.PathLike, load: LoadConfig) -> PoolFile:
    """The pool file, refused when compressed and load's rows are not read in place."""
    pools = PoolFile(pool_path)
    if pools.compressed and load.rows != "in_place":
        raise PairedCacheError(
            f"rows={load.rows!r} (window={load.window}): {pool_path} is a compressed pool, "
            f"read in place only; use rows='in_place' (window 1), or an uncompressed pool"
        )
    return pools


def _map_safetensors(model_dir: Path, pools: PoolFile, pool_path, random_access: bool) -> dict:
    """{tensor name: its SafetensorsMap} over model_dir's files, whose MLP weights must be
    of the pools' dtype."""
    maps = [SafetensorsMap(p, random_access=random_access) for p in _safetensors_files(model_dir)]
    where = {name: m for m in maps for name in m.entries}
    _check_dtype(where, pools, pool_path, model_dir)
    return where


def _meta_model(hf_config, pools: PoolFile, pool_path, model_dir: Path):
    """(the model built on the meta device in the pools' dtype, its gated MLPs' names),
    refused when the pool file's layers are not those MLPs."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=pools.dtype)
    mlp_names = [
        name
        for name, module in model.named_modules()
        if (layout := mlp_layout(module)) is not None and layout.gated
    ]
    if [layer.name for layer in pools.layers] != mlp_names:
        raise PairedCacheError(
            f"{pool_path} holds layers {[layer.name for layer in pools.layers][:3]}..., the model "
            f"built from {model_dir} has MLPs {mlp_names[:3]}... ({len(mlp_names)})"
        )
    return model, mlp_names


def _check_all_mapped(model: nn.Module, model_dir: Path) -> None:
    """Refuse a model with a parameter or buffer still on the meta device."""
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise PairedCacheError(f"{model_dir}: no weights for {left[:5]} ({len(left)} tensors)")


def _attach_page_hooks(
    model: nn.Module,
    mlp_names: list[str],
    pools: PoolFile,
    where: dict,
    used: set[str],
    load: LoadConfig,
) -> None:
    """The read-ahead and keep-cached hooks that load's read_ahead and keep_cached ask for."""
    if load.read_ahead or load.keep_cached is not None:
        attach_page_hooks(
            model,
            mlp_names,
            pools,
            where,
            used,
            in_place=load.rows == "in_place",
            read_ahead=load.read_ahead,
            keep_cached=load.keep_cached,
        )


def _check_dtype(where: dict, pools: PoolFile, pool_path, model_dir: Path) -> None:
    """The pools' dtype is the dtype of the MLP weights in the safetensors."""
    dtypes = {
        where[n].entries[n][0] for n in where if n.endswith((MLP_SUFFIXES[0], FUSED_SUFFIXES[0]))
    }
    if dtypes and dtypes != {pools.dtype}:
        raise PairedCacheError(
            f"{pool_path} holds {pools.dtype} pools but {model_dir}'s MLPs are {sorted(map(str, dtypes))}"
        )


def _source_options(options: dict, mlp_names: list[str]) -> dict:
    """The mask source's options, a predictor=PATH (a file of save_predictors, mapped)
    turned into weights=, one set per MLP."""
    options = dict(options)
    if "predictor" in options:
        predictors = load_predictors(options.pop("predictor"), mapped=True)
        missing = [name for name in mlp_names if name not in predictors]
        if missing:
            raise PairedCacheError(f"the predictor file has no weights for {missing[:3]}")
        options["weights"] = [predictors[name] for name in mlp_names]
    return options


def _put_sparse_mlp(
    model: nn.Module,
    name: str,
    pools: PoolFile,
    where: dict,
    used: set[str],
    load: LoadConfig,
    options: dict,
) -> None:
    """Replace MLP `name` (still on the meta device) by a SparseMLP over its pool."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    mlp = getattr(parent, child)
    # The mask source scores with the contiguous gate_proj of the safetensors when they
    # hold it: the pool's gate block shares its pages with the up and down rows.
    gate = None
    for suffix in (MLP_SUFFIXES[0], FUSED_SUFFIXES[0]):
        gate_key = f"{name}.{suffix}"
        if gate_key in where:
            gate = where[gate_key].tensor(gate_key)
            gate = gate[: gate.shape[0] // 2] if suffix == FUSED_SUFFIXES[0] else gate
            used.add(gate_key)
            break
    build = CompressedSparseMLP if pools.compressed else SparseMLP
    sparse = build.from_pool_file(
        pools,
        name,
        activation(mlp, mlp_layout(mlp)),
        load.source,
        load.fraction,
        config=load.config,
        window=load.window,
        gate=gate,
        rows=load.rows,
        prefill=load.prefill,
        **options,
    )
    setattr(parent, child, sparse)


def _map_parameters(model: nn.Module, where: dict, used: set[str]) -> None:
    """Point every parameter the safetensors hold at its mapped bytes (read-only)."""
    for module_name, module in model.named_modules():
        for pname in [name for name, _ in module.named_parameters(recurse=False)]:
            full = f"{module_name}.{pname}" if module_name else pname
            if full in where:
                module._parameters[pname] = nn.Parameter(
                    where[full].tensor(full), requires_grad=False
                )
                used.add(full)


def _make_unsaved(model: nn.Module, hf_config) -> None:
    """What a checkpoint does not store: the tied embedding's second name, Gemma's
    embed_scale and the rotary embeddings' inv_freq."""
    if getattr(hf_config, "tie_word_embeddings", False):
        # A tied checkpoint stores one of the two (save_model may keep either name).
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        weight = head.weight if embed.weight.is_meta else embed.weight
        embed.weight = head.weight = weight
    for module_name, module in list(model.named_modules()):
        if module_name and any(b.is_meta for b in module.buffers(recurse=False)):
            scale = module._buffers.get("embed_scale")
            if scale is not None and scale.is_meta and hasattr(module, "scalar_embed_scale"):
                # Gemma's scaled embedding keeps its scale (sqrt(hidden)) in a buffer it does
                # not save: made again from the float it keeps beside it.
                module._buffers["embed_scale"] = torch.tensor(
                    module.scalar_embed_scale, dtype=scale.dtype
                )
                continue
            if not type(module).__name__.endswith("RotaryEmbedding"):
                continue  # left for the check in load_sparse, which names it
            # Rotary embeddings' inv_freq is computed from the config, not stored.
            parent_name, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, type(module)(config=hf_config))


__all__ = [
    "LoadConfig",
    "convert",
    "iter_mlp_weights",
    "load_sparse",
    "save_dense",
]
