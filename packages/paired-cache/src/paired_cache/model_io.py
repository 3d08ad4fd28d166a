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
import functools
import json
import mmap
import os
import struct
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from paired_cache._pages import MappedPages, memory_groups, page_cache_room
from paired_cache.config import CacheConfig
from paired_cache.errors import PairedCacheError
from paired_cache.mlp_layouts import activation, gated_weights, mlp_layout
from paired_cache.pool_file import PoolFile, write_pool_file

ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
}
MLP_SUFFIXES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
# Phi-3's MLP: gate and up in one (2N, hidden) weight, the gate's rows first.
FUSED_SUFFIXES = ("gate_up_proj.weight", "down_proj.weight")


class SafetensorsMap(MappedPages):
    """A .safetensors file mapped read-only: tensor(name) is a zero-copy view of its bytes.

    random_access: advise the mapping ``MADV_RANDOM``, so that a page fault reads its page
    only and not the device's read-ahead around it (8 MiB on this machine's disk, which
    drags in the tensors stored next to the one asked for, e.g. the up and down
    projections a pool file replaces); ask for what is read in full with ``will_need``.
    """

    def __init__(self, path: str | os.PathLike, *, random_access: bool = False) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise PairedCacheError(f"{self.path}: too short for safetensors")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise PairedCacheError(f"{self.path}: header length {n} past the file's end")
            try:
                meta = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise PairedCacheError(f"{self.path}: header is not JSON ({exc})") from None
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if random_access and hasattr(mmap, "MADV_RANDOM"):
            self._mmap.madvise(mmap.MADV_RANDOM)
        if not isinstance(meta, dict):
            raise PairedCacheError(f"{self.path}: header is not a JSON object")
        meta.pop("__metadata__", None)
        self._start, self._size = 8 + n, size
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in meta.items():
            try:
                dtype = ST_DTYPES[entry["dtype"]]
                shape = tuple(int(s) for s in entry["shape"])
                begin, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise PairedCacheError(
                    f"{self.path}: bad entry for {name}: {entry!r:.120}"
                ) from None
            count = 1
            for s in shape:
                count *= s
            if (
                any(s < 0 for s in shape)
                or end - begin != count * dtype.itemsize
                or begin < 0
                or self._start + end > size
            ):
                raise PairedCacheError(f"{self.path}: {name} {shape} does not fit its bytes")
            self.entries[name] = (dtype, shape, self._start + begin, self._start + end)

    def ranges(self, names) -> list[tuple[int, int]]:
        """The byte ranges of tensors ``names`` in the file, in file order, tensors less than
        a page apart merged into one range (so merging reads no other tensor's pages)."""
        spans = sorted(self.entries[n][2:] for n in names)
        out: list[list[int]] = []
        for begin, end in spans:
            if out and begin - out[-1][1] < mmap.PAGESIZE:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([begin, end])
        return [(b, e) for b, e in out if e > b]

    def will_need(self, name: str) -> None:
        """Have the kernel read tensor ``name``'s bytes now, in one asynchronous request
        over exactly its range (``MADV_WILLNEED``); pages already cached cost a lookup."""
        _, _, begin, end = self.entries[name]
        self.will_need_range(begin, end)

    def tensor(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        if begin % dtype.itemsize:
            raise PairedCacheError(f"{self.path}: {name} is not aligned to its element size")
        with warnings.catch_warnings():
            # Read-only on purpose: a write faults instead of copying the page.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(memoryview(self._mmap)[begin:end], dtype=torch.uint8)
        return flat.view(dtype).view(shape)


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
    """(name, gate (N, h), up (N, h), down (h, N)) of every gated MLP of a model on storage:
    a HF directory or .safetensors file (read through the mapping), or a .gguf file
    (loaded and dequantised by transformers)."""
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


def convert(
    source: str | os.PathLike, out: str | os.PathLike, *, gate: bool = True, progress: bool = True
):
    """Write every gated MLP of the model at source into the pool file out; returns its
    PoolLayer list. Nothing is left at out when it fails.

    gate=False writes rows of up | down_T only (gate_cols 0): a third smaller for a
    SwiGLU MLP, for load_sparse with a mask source that computes act(gate x) itself
    ("cats", "trained" with the gated predictor) from gate_proj mapped from the model's
    safetensors. Every row a token reads, and every layer the in-place read-ahead asks
    for, is then the bytes the kernel multiplies and nothing else."""
    if not isinstance(gate, bool):
        raise PairedCacheError(f"gate must be a bool, got {gate!r}")
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
    return write_pool_file(out, layers, progress=bar)


def save_dense(model: nn.Module, directory: str | os.PathLike, tokenizer=None) -> Path:
    """Write a dense transformers model as the directory convert and load_sparse read:
    config.json, model.safetensors (the model's own dtype) and, when given, the tokenizer.

    Unlike save_pretrained it takes a model loaded from a GGUF (whose weights are plain
    float tensors once transformers dequantised them; save_pretrained refuses it). Written
    to a temporary directory beside `directory` and renamed: `directory` must not exist
    (or be empty), and a failure leaves nothing there. A sparsified model is refused.
    """
    import shutil
    import tempfile

    from safetensors.torch import save_model

    from paired_cache.pool_file import umask_mode
    from paired_cache.sparse_base import SAVE_REFUSED, CachedMLP

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


def load_sparse(
    model_dir: str | os.PathLike,
    pool_path: str | os.PathLike,
    source: str = "cats",
    fraction: float = 0.5,
    *,
    config: CacheConfig | None = None,
    window: int = 1,
    rows: str | None = None,
    read_ahead: bool = True,
    keep_cached: int | str | None = "auto",
    prefill: str = "dense",
    **options,
):
    """A transformers causal LM whose MLPs are SparseMLPs over the pool file's mapped pools
    and whose other weights are views of the mapped safetensors of model_dir (config.json
    and *.safetensors): nothing is copied into anonymous memory but the caches' active rows
    and what the mask sources build. source: a MASK_SOURCES name whose build needs no
    calibration inputs ("cats", "oracle", or "trained" with predictor=PATH, a file of
    paired_cache.trained_predictor.save_predictors). rows: "in_place" (each token's rows
    multiplied where they lie in the mapped pool, no active rows kept; window 1) or "copy"
    (the paired-replacement cache of active rows, anonymous memory; any window):
    SparseMLP.from_pool_file. None (the default): "in_place" for window 1, else "copy".
    In place is faster and fits a lower hard limit (README, "Under a hard memory limit");
    copying is what a window > 1 needs. prefill: "dense" (the default: a prompt's MLPs
    over every row at once, exact; decoding stays sparse) or "sparse" (a prompt's tokens
    each with its own mask, as decoding): SparseMLP.prefill.

    read_ahead: the safetensors are mapped ``MADV_RANDOM`` and, as each decoder layer
    starts, the kernel is asked (``MADV_WILLNEED``) for the mapped tensors the next one
    reads in full (attention, the gate the mask source scores with; after the last layer
    the lm_head, after the lm_head the first layer's), and with ``rows="in_place"`` for
    the next layer's whole pool where keep_cached keeps it; ranges that look cached are
    skipped (see _add_read_ahead). The next layer's reads overlap this one's compute, and
    nothing else in the file is read ahead with them. ``read_ahead=False``: no read-ahead
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
    model's ``page_keeper`` (a PageKeeper) says which blocks it kept at the last token.
    README, "Under a hard memory limit": what each of these saves under the budget
    runner's tight profile.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from paired_cache.sparse_mlp import SparseMLP, check_prefill, guard_sparse_model

    check_prefill(prefill)
    if rows is None:
        rows = "in_place" if window == 1 else "copy"
    if not (
        keep_cached is None
        or keep_cached == "auto"
        or (isinstance(keep_cached, int) and not isinstance(keep_cached, bool) and keep_cached >= 0)
    ):
        raise PairedCacheError(
            f"keep_cached must be 'auto', None or a byte count >= 0, got {keep_cached!r}"
        )
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        # transformers would take a missing directory for a hub repo id and say so.
        what = "does not exist" if not model_dir.exists() else "holds no config.json"
        raise PairedCacheError(
            f"{model_dir} {what}: load_sparse needs a model directory (config.json and "
            f"*.safetensors; save a .gguf-loaded model there with save_pretrained)"
        )
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    pools = PoolFile(pool_path)
    maps = [SafetensorsMap(p, random_access=read_ahead) for p in _safetensors_files(model_dir)]
    where = {name: m for m in maps for name in m.entries}
    used: set[str] = set()  # the mapped tensors the model reads
    dtypes = {
        where[n].entries[n][0] for n in where if n.endswith((MLP_SUFFIXES[0], FUSED_SUFFIXES[0]))
    }
    if dtypes and dtypes != {pools.dtype}:
        raise PairedCacheError(
            f"{pool_path} holds {pools.dtype} pools but {model_dir}'s MLPs are {sorted(map(str, dtypes))}"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=pools.dtype)
    mlp_names = [
        name
        for name, module in model.named_modules()
        if (layout := mlp_layout(module)) is not None and layout.gated
    ]
    if [pools.layers[i].name for i in range(len(pools.layers))] != mlp_names:
        raise PairedCacheError(
            f"{pool_path} holds layers {[layer.name for layer in pools.layers][:3]}..., the model "
            f"built from {model_dir} has MLPs {mlp_names[:3]}... ({len(mlp_names)})"
        )
    if "predictor" in options:  # a file of save_predictors: one set of weights per MLP
        from paired_cache.trained_predictor import load_predictors

        predictors = load_predictors(options.pop("predictor"), mapped=True)
        missing = [name for name in mlp_names if name not in predictors]
        if missing:
            raise PairedCacheError(f"the predictor file has no weights for {missing[:3]}")
        options["weights"] = [predictors[name] for name in mlp_names]
    for name in mlp_names:
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
        sparse = SparseMLP.from_pool_file(
            pools,
            name,
            activation(mlp, mlp_layout(mlp)),
            source,
            fraction,
            config=config,
            window=window,
            gate=gate,
            rows=rows,
            prefill=prefill,
            **options,
        )
        setattr(parent, child, sparse)
    for module_name, module in model.named_modules():
        for pname in [name for name, _ in module.named_parameters(recurse=False)]:
            full = f"{module_name}.{pname}" if module_name else pname
            if full in where:
                module._parameters[pname] = nn.Parameter(
                    where[full].tensor(full), requires_grad=False
                )
                used.add(full)
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
                continue  # left for the check below, which names it
            # Rotary embeddings' inv_freq is computed from the config, not stored.
            parent_name, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, type(module)(config=hf_config))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise PairedCacheError(f"{model_dir}: no weights for {left[:5]} ({len(left)} tensors)")
    model.eval()
    guard_sparse_model(model)
    if read_ahead or keep_cached is not None:
        blocks = [_layer_block(model, name.rpartition(".")[0], where, used) for name in mlp_names]
        # In place, each token reads about half of every row's up | down_T part, scattered:
        # 4 KiB faults, one at a time. Asking for the layer's whole pool ahead reads more
        # bytes, in requests the device serves at its bandwidth.
        pool_ranges = [
            [(pools, pools.layer_range(i))] if rows == "in_place" else []
            for i in range(len(mlp_names))
        ]
        head = _head_block(model, where, used)
        blocks += [head] if head else []
        extra = [*pool_ranges, []][: len(blocks)]
        keeper = None

        def prune_once(_model, _args) -> None:
            _prune_replaced(model, blocks)
            if keeper is not None:
                keeper.measure()
            handle.remove()

        handle = model.register_forward_pre_hook(prune_once)
        if keep_cached is not None:
            keeper = model.page_keeper = PageKeeper(blocks, extra, keep_cached)
            keeper.attach()
            if rows == "in_place":
                for i, name in enumerate(mlp_names):
                    model.get_submodule(name).will_read_rows = functools.partial(
                        keeper.read_rows, i, pools, i
                    )
        if read_ahead:
            _add_read_ahead(
                blocks,
                extra,
                None if keeper is None else keeper.is_kept,
                None if keeper is None else lambda: keeper.roomy,
            )
    return model


Block = tuple[nn.Module, list[tuple[SafetensorsMap, str]]]


def _prune_replaced(model: nn.Module, blocks: list[Block]) -> None:
    """At the first forward, drop from each block the mapped tensors the model no longer
    holds: a module replaced after load_sparse returned (another package's, such as
    zstd-linear's load_compressed of the attention projections and the embedding) reads
    its weights elsewhere, and reading its old ranges ahead, or keeping them cached, would
    read bytes no forward uses."""
    for _module, own in blocks:
        own[:] = [(mapping, name) for mapping, name in own if _still_held(model, mapping, name)]


def _still_held(model: nn.Module, mapping: SafetensorsMap, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return True  # not a module of the model's: a SparseMLP's gate, which it reads
    held = module._parameters.get(attr, module._buffers.get(attr))
    return held is not None and held.data_ptr() == mapping.tensor(name).data_ptr()


def _layer_block(model: nn.Module, prefix: str, where, used: set[str]) -> Block:
    """A decoder layer and the mapped tensors it reads in full (all but the embedding's)."""
    names = sorted(n for n in used if n.startswith(prefix + "."))
    return model.get_submodule(prefix), [(where[n], n) for n in names]


def _head_block(model: nn.Module, where, used: set[str]) -> Block | None:
    """The output embedding (lm_head) and its mapped weight: its own, or the input
    embedding's where they are tied."""
    head = model.get_output_embeddings()
    if head is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    key = f"{names[id(head)]}.weight"
    embed = model.get_input_embeddings()
    if key not in used and embed is not None and embed.weight is head.weight:
        key = f"{names[id(embed)]}.weight"
    return (head, [(where[key], key)]) if key in used else None


def _tensor_ranges(tensors) -> list[tuple[MappedPages, tuple[int, int]]]:
    """(mapping, (begin, end)) ranges holding the (mapping, name) tensors, merged per file."""
    by_map: dict[int, tuple[SafetensorsMap, list[str]]] = {}
    for mapping, name in tensors:
        by_map.setdefault(id(mapping), (mapping, []))[1].append(name)
    return [(m, r) for m, names in by_map.values() for r in m.ranges(names)]


class PageKeeper:
    """load_sparse's keep_cached: of the ranges each block reads in full every token, some
    blocks' stay cached and every other block's are paged out when the block is done.
    Blocks are kept largest first (SmolLM2: the lm_head, then the layers in reading order),
    as many as the budget takes, set as each token starts (the first block's forward
    pre-hook). "auto" leaves room for the two largest consecutive blocks that are not kept
    (one being read, the next read ahead) and MARGIN, from the room the process's memory
    cgroups leave for page cache (the groups looked up once, at the first token)."""

    MARGIN = 4 * 2**20

    def __init__(self, blocks: list[Block], extra, keep: int | str) -> None:
        self.blocks, self.extra = blocks, extra
        self.modules = [module for module, _ in blocks]
        self.measure()
        self.keep = keep
        self.kept: set[int] = set(range(len(blocks)))  # the blocks kept cached this token
        self.paged_out = 0  # bytes asked to be paged out, over the model's life
        self.groups: list | None = None  # the process's memory cgroups, looked up once
        # "auto" found, at this token, no memory limit or one that leaves room for twice
        # everything the blocks read: nothing of the model's is paged out or pressed.
        self.roomy = False

    def measure(self) -> None:
        """The ranges and sizes of the blocks' tensors (again after they were pruned)."""
        self.ranges = [
            _tensor_ranges(own) + more
            for (_, own), more in zip(self.blocks, self.extra, strict=True)
        ]
        self.sizes = [sum(end - begin for _, (begin, end) in r) for r in self.ranges]
        self.order = sorted(range(len(self.blocks)), key=lambda i: (-self.sizes[i], i))

    def _in_flight(self, kept: set[int]) -> int:
        n = len(self.sizes)
        return max(
            (
                self.sizes[i] + (self.sizes[(i + 1) % n] if (i + 1) % n not in kept else 0)
                for i in range(n)
                if i not in kept
            ),
            default=0,
        )

    def plan(self) -> None:
        if self.keep == "auto":
            if self.groups is None:
                self.groups = memory_groups()
            room = page_cache_room(self.groups)
            self.roomy = room is None
            if room is None:  # no limit: the page cache is the kernel's
                self.kept = set(range(len(self.sizes)))
                return
        kept: set[int] = set()
        total = 0
        for i in self.order:
            trial = kept | {i}
            if self.keep == "auto":
                fits = total + self.sizes[i] + self._in_flight(trial) + self.MARGIN <= room
            else:
                fits = total + self.sizes[i] <= int(self.keep)
            if fits:
                kept, total = trial, total + self.sizes[i]
        self.kept = kept
        self.roomy = self.keep == "auto" and len(kept) == len(self.sizes) and room >= 2 * total

    def is_kept(self, i: int) -> bool:
        return i in self.kept

    def read_rows(self, block: int, pools: PoolFile, layer: int, rows: torch.Tensor) -> None:
        """In place, a layer whose pool is not kept reads the token's picked rows only
        (their pages, asked for once the mask is known); a kept one was read whole."""
        if block not in self.kept:
            pools.will_need_rows(layer, rows.numpy())

    def done(self, i: int) -> None:
        if i not in self.kept:
            for mapping, (begin, end) in self.ranges[i]:
                if mapping.page_out_range(begin, end):
                    self.paged_out += end - begin

    def attach(self) -> None:
        if not self.modules:
            return
        self.modules[0].register_forward_pre_hook(lambda _m, _a: self.plan())
        for i, module in enumerate(self.modules):
            module.register_forward_hook(lambda _m, _a, _o, i=i: self.done(i))


RECHECK_TOKENS = 16


def _add_read_ahead(blocks: list[Block], extra=None, extra_wanted=None, roomy=None) -> None:
    """A forward pre-hook on each block asks for the next block's mapped tensors (the last
    block's, the head's, for the first block's: the next token starts there; the first
    block asks for its own too), so that their read overlaps this block's compute.
    Tensors stored side by side are asked for as one range (SmolLM2: the input norm, the
    gate, and the post-attention norm with the attention projections), and only ranges
    that do not look cached (``is_cached(sample=True)``) are asked for: asking for cached
    pages still walks them in the kernel (SmolLM2 under ample memory: 7 ms of a 47 ms
    token for 0.10's ~480 asks per token). extra[i]: more (mapping, (begin, end)) ranges
    block i reads, asked for with its tensors (a pool file's layer, in place) where
    extra_wanted(i) says so at that moment (None: always; load_sparse passes its
    PageKeeper's is_kept: a layer not kept reads its picked rows only). The hooks stay
    with the model, which load_sparse built.

    roomy() (load_sparse passes its PageKeeper's, None: never) says that this token no
    memory limit applies, or one that leaves room for twice what the blocks read; then a
    range found cached within the last RECHECK_TOKENS tokens is not looked at again
    (SmolLM2 under ample memory: ~125 ranges a token, each three mincore calls, 1.3 ms of
    a 38 ms token). Otherwise every range is looked at every token. With that much room
    the model's pages are evicted only when something else fills it (or the whole
    machine's memory is short); a range evicted then is faulted in, page by page, for up
    to RECHECK_TOKENS tokens before it is asked for again."""
    extra = extra if extra is not None else [[] for _ in blocks]
    token = [0]  # tokens started: the first block's hook counts them
    seen_cached: dict[tuple[int, int, int], int] = {}  # (mapping, begin, end) -> token

    def tagged(j):  # block j's ranges: its tensors' (always) and its extra ones (tag j)
        return [(m, r, None) for m, r in _tensor_ranges(blocks[j][1])] + [
            (m, r, j) for m, r in extra[j]
        ]

    asks: dict[int, list] = {}  # block -> ranges it asks for, set at its first call (the
    # blocks' tensors are pruned at the model's first forward: _prune_replaced)

    for i, (module, _own) in enumerate(blocks):

        def ask(_module, _args, i=i, first=i == 0) -> None:  # args unchanged
            if i not in asks:
                after = (i + 1) % len(blocks)
                asks[i] = tagged(after) if i else tagged(0) + tagged(after)
            wanted = asks[i]
            token[0] += first
            trust = roomy is not None and roomy()
            for mapping, (begin, end), j in wanted:
                if j is not None and extra_wanted is not None and not extra_wanted(j):
                    continue
                key = (id(mapping), begin, end)
                if trust and token[0] - seen_cached.get(key, -RECHECK_TOKENS) < RECHECK_TOKENS:
                    continue
                if mapping.is_cached(begin, end, sample=True):
                    seen_cached[key] = token[0]
                else:
                    seen_cached.pop(key, None)
                    mapping.will_need_range(begin, end)

        module.register_forward_pre_hook(ask)


__all__ = [
    "PageKeeper",
    "SafetensorsMap",
    "convert",
    "iter_mlp_weights",
    "load_sparse",
    "save_dense",
]
