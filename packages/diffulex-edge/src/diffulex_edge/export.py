"""Export the static graphs to an ExecuTorch ``.pte`` through the XNNPACK backend.

Three graph variants (registry :data:`EXPORT_VARIANTS`):

- ``cache_io``: :meth:`SDARModel.forward_export` as designed; every step passes the whole
  cache plus three per-layer masks in and gets the whole updated cache back.
- ``block_kv``: :meth:`SDARModel.forward_block_kv` in the style of ExecuTorch's
  StaticAttention; the cache is a read-only input and only the block's K/V come back.
  XNNPACK and portable kernels only.
- ``static_kv``: :class:`StaticKVGraph`; the cache is mutable state inside the program,
  written and read by ExecuTorch's LLM custom ops (``llama::update_cache``,
  ``llama::custom_sdpa``), which the runtime must include (the PyPI wheels do). The
  fastest: no cache crosses the method boundary and attention reads only the filled slots.

The program also carries constant methods describing what it was exported for (format
version, variant, cache geometry, token ids, a digest of the model config), and an
integrity record ``<name>.pte.json`` is written next to it
(:mod:`diffulex_edge.pte_record`); :class:`diffulex_edge.runtime.PteEngine` verifies the
record before any byte reaches ExecuTorch, and the constants before running anything.
"""

from __future__ import annotations

import copy
import hashlib
import os
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import nn

from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.executorch_import import lowering
from diffulex_edge.export_config import ExportConfig
from diffulex_edge.files import umask_mode
from diffulex_edge.kv_cache import StaticCacheLayout
from diffulex_edge.masks import block_attention_mask, block_positions, cache_io_masks
from diffulex_edge.model import SDARModel
from diffulex_edge.program_meta import QUANTIZATIONS as QUANTIZATIONS  # re-exported
from diffulex_edge.program_meta import VARIANT_IDS
from diffulex_edge.progress import StageProgress
from diffulex_edge.pte_record import write_record
from diffulex_edge.split_head import HEAD_INT8_SHARE

# 8da4w-mixed: the linear layers whose weights stay int8 (one scale per row). On SmolLM2
# they carry most of 8da4w's perplexity loss (benchmarks/smollm2_quant_ablation.py).
MIXED_INT8_LAYERS = ("down_proj", "lm_head")
# The linear layers that keep a 4-bit grid they are found on (quantize_8da4w's ``grid``).
# Each kept grid costs its layer two small int8 products and an add in the program. On
# SmolLM2 these three kinds keep most of the perplexity that keeping every grid layer
# saves, at 90 of its 210 layers' cost (the README's quantization table; 0.14).
GRID_LAYERS = ("v_proj", "o_proj", "down_proj")
# The method that runs causal prefill chunks, when a program has one (block_kv only).
PREFILL_METHOD = "prefill"


class CacheIOGraph(nn.Module):
    variant_id = VARIANT_IDS["cache_io"]

    def __init__(self, model: SDARModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, kv_cache, attention_mask, insert_matrix, keep_mask):
        return self.model.forward_export(
            input_ids, positions, kv_cache, attention_mask, insert_matrix, keep_mask
        )

    @staticmethod
    def example_inputs(layout: StaticCacheLayout) -> tuple[torch.Tensor, ...]:
        masks = cache_io_masks(layout, 0, commit=True)
        ids = torch.zeros(layout.batch, layout.block_size, dtype=torch.long)
        return (
            ids,
            block_positions(layout, 0),
            layout.allocate(),
            masks.attention_mask,
            masks.insert_matrix,
            masks.keep_mask,
        )


class BlockKVGraph(nn.Module):
    variant_id = VARIANT_IDS["block_kv"]

    def __init__(self, model: SDARModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, kv_cache, attention_mask):
        return self.model.forward_block_kv(input_ids, positions, kv_cache, attention_mask)

    @staticmethod
    def example_inputs(layout: StaticCacheLayout) -> tuple[torch.Tensor, ...]:
        ids = torch.zeros(layout.batch, layout.block_size, dtype=torch.long)
        return ids, block_positions(layout, 0), layout.allocate(), block_attention_mask(layout, 0)


class StaticKVGraph(nn.Module):
    """The cache lives in the program: one mutable buffer per layer for K and one for V,
    ``(1, max_seq, kv_heads, head_dim)``, written in place by ExecuTorch's
    ``llama::update_cache`` and read by ``llama::custom_sdpa``, which attends to slots
    ``[0, start + T)`` only (the layout and kernels optimum-executorch exports Llama with).

    ``forward(input_ids (1, T), input_pos (1,) int64 = start) -> logits (1, T, vocab)``
    writes the T tokens' K/V at ``start``. Block size 1 (autoregressive) attends causally and
    takes any T from 1 to the prefill size, so the prompt enters in chunks through the same
    method; a larger block attends to the whole block (block diffusion) with T = block size.
    A forward that does not commit (a denoising step) writes slots past the committed
    tokens, which the next forward at that start overwrites before reading.
    """

    variant_id = VARIANT_IDS["static_kv"]

    def __init__(self, model: SDARModel, max_seq: int, block_size: int) -> None:
        super().__init__()
        from diffulex_edge.executorch_import import llm_custom_ops

        llm_custom_ops()
        c = model.config
        self.model = model
        self.max_seq = max_seq
        self.is_causal = block_size == 1
        shape = (1, max_seq, c.num_key_value_heads, c.head_dim)
        for i in range(c.num_hidden_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape), persistent=False)

    def forward(self, input_ids, input_pos):
        m = self.model
        B, T = input_ids.shape
        start = input_pos[0].item()
        torch._check_is_size(start)
        torch._check(start + T <= self.max_seq)
        rope = {
            kind: None
            if t is None
            else tuple(torch.narrow(x, 0, start, T)[None, :, None, :] for x in t)
            for kind, t in m.rope_tables().items()
        }
        h = m.embed(input_ids)
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            cos, sin = rope[layer.rope] or (None, None)
            q, k, v = attn.heads(layer.attention_input(h), cos, sin)
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            torch.ops.llama.update_cache(k, k_cache, start)
            torch.ops.llama.update_cache(v, v_cache, start)
            if attn.needs_explicit_scores:
                out = attn.attend(
                    q.transpose(1, 2),
                    k_cache.transpose(1, 2),
                    v_cache.transpose(1, 2),
                    self._slot_mask(input_pos, T, attn.sliding_window),
                )
            else:
                out = torch.ops.llama.custom_sdpa(
                    q, k_cache, v_cache, start, None, 0.0, self.is_causal, attn.scaling
                )
                out = attn.o_proj(out.reshape(B, T, attn.num_heads * attn.head_dim))
            h = layer.add_mlp(layer.add_attention(h, out))
        return m._logits(h)

    def _slot_mask(self, input_pos, T: int, window: int | None) -> torch.Tensor:
        """The additive mask over every cache slot, (1, 1, T, max_seq), for a layer whose
        scores custom_sdpa cannot compute (soft-capped, sliding-window): slot j (holding
        position j) is visible to the query at position p when j <= p (block size 1; the
        whole block with a larger one) and, with a window, p - j < window. Slots past the
        block hold stale keys and are hidden."""
        q_pos = input_pos + torch.arange(T)  # (T,)
        last = q_pos if self.is_causal else (input_pos + T - 1).expand(T)
        slots = torch.arange(self.max_seq)
        hidden = slots[None, :] > last[:, None]  # (T, max_seq)
        if window is not None:
            hidden = hidden | ((q_pos[:, None] - slots[None, :]) >= window)
        return torch.zeros(hidden.shape).masked_fill(hidden, -torch.inf)[None, None]

    @staticmethod
    def example_inputs(layout: StaticCacheLayout) -> tuple[torch.Tensor, ...]:
        ids = torch.zeros(layout.batch, layout.block_size, dtype=torch.long)
        return ids, torch.zeros(1, dtype=torch.long)


EXPORT_VARIANTS: dict[str, type[nn.Module]] = {
    "cache_io": CacheIOGraph,
    "block_kv": BlockKVGraph,
    "static_kv": StaticKVGraph,
}


# Modules that only load, run or train programs: no export runs their code.
_RUN_ONLY_MODULES = frozenset(
    {
        "__about__.py",
        "cli.py",
        "generate.py",
        "page_lock.py",
        "remasking.py",
        "runtime.py",
        "sampling.py",
        "xnnpack_weight_cache.py",
    }
)


@cache
def export_code_digest() -> str:
    """SHA-256 (hex) of what decides the program :func:`export_pte` writes for a given
    model and arguments, other than the model: the source of every module of this package
    an export can run (all but the run-only ones), the calibration text, and the torch,
    ExecuTorch and torchao versions. A cache of exported programs keyed by it (the test suite's, the demo's)
    stays valid across releases that change only how programs are run."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    here = Path(__file__).parent
    for path in [*sorted(here.glob("*.py")), here / "calibration.txt"]:
        if path.name not in _RUN_ONLY_MODULES:
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for package in ("torch", "executorch", "torchao"):
        try:
            h.update(f"{package}=={version(package)}\0".encode())
        except PackageNotFoundError:
            h.update(f"{package} missing\0".encode())
    return h.hexdigest()


def quantize_8da4w(
    model: SDARModel,
    group_size: int = 32,
    int8_layers: tuple[str, ...] = (),
    calibration=None,
    clip: bool = True,
    int8_embedding: bool = True,
    gptq: bool | None = None,
    grid: bool | tuple[str, ...] = GRID_LAYERS,
    head_int8_share: float = HEAD_INT8_SHARE,
) -> SDARModel:
    """Int8 dynamic activations, int4 grouped weights on every linear layer (torchao), each
    int4 group's scale from the clipping range that rounds best on calibration text
    (:mod:`diffulex_edge.calibration`) and, given text, its codes chosen by GPTQ on the same
    text (:mod:`diffulex_edge.gptq`); the embedding table int8, one scale per row
    (:class:`~diffulex_edge.embedding.Int8Embedding`, which any ExecuTorch runtime runs).
    An int4 layer of ``grid``'s kinds whose weight already lies on a 4-bit grid of
    ``group_size`` inputs (a GGUF's Q4_0 / Q4_1 tensors, a GPTQ or AWQ checkpoint,
    dequantized) keeps that grid instead of being rounded again: its steps become the
    scales, and the groups' offsets an int8 product on the input's group sums
    (:mod:`diffulex_edge.grid`). An int4 ``lm_head`` not on a grid keeps the rows of the
    tokens likeliest on the calibration text in int8 (``head_int8_share`` of them;
    :mod:`diffulex_edge.split_head`).

    Works in place on ``model`` (pass a copy to keep the float one). Needs the ``quant``
    extra. Every argument is checked before the model changes.

    Args:
        model: the model to quantize.
        group_size: inputs per int4 group (XNNPACK: a multiple of 32).
        int8_layers: linear layers, named by the last part of their module name (e.g.
            ``"down_proj"``, ``"lm_head"``), whose weights are int8 with one scale per
            output row instead (8da8w, which XNNPACK also lowers): the ``8da4w-mixed``
            quantization passes :data:`MIXED_INT8_LAYERS`.
        calibration: token ids (1-D) of text in the model's vocabulary
            (``diffulex_edge.calibration.calibration_ids(tokenizer)`` for the package's
            text); None: ``random_ids`` of the vocabulary, which calibrate less well.
        clip: False rounds each group min-max to nearest, with no calibration (before
            0.11).
        int8_embedding: False keeps the embedding table float (before 0.11).
        gptq: whether GPTQ chooses the codes of the clipped groups, or they are rounded to
            nearest (0.11). None: GPTQ when ``calibration`` is given; on random ids it
            fit held-out text worse than rounding to nearest. True needs ``clip``.
        grid: which int4 layers already on a 4-bit grid keep it, named by the last part
            of their module name (default :data:`GRID_LAYERS`, 0.14: ``v_proj``,
            ``o_proj``, ``down_proj``); True: every one (0.13, slower); False: none, they
            are rounded like the others (before 0.13). ``clip``, ``calibration`` and
            ``gptq`` apply to the layers that do not keep a grid.
        head_int8_share: with ``clip``, the share of an int4 ``lm_head``'s rows (not on a
            grid) that are int8 instead: those of the tokens the model, before it is
            quantized, finds likeliest on the calibration ids (0.13, a twelfth by default);
            0 keeps every row int4 (before 0.13).

    Returns:
        ``model``, quantized.

    Raises:
        ValueError: ``int8_layers`` or ``grid`` naming no linear layer, or an int4 layer's
            ``in_features`` not divisible by ``group_size``.
        DiffulexEdgeError: calibration ids that are not 1-D integers in the vocabulary, a
            flag that is not a bool (``gptq``: nor None; ``grid``: nor a tuple of names),
            or calibration ids or ``gptq=True`` with ``clip=False``, a
            ``head_int8_share`` outside [0, 1).
    """
    from diffulex_edge.calibration import (
        check_ids,
        clip_int4_layers,
        random_ids,
        round_int4_scales,
        untie_weight,
    )
    from diffulex_edge.embedding import quantize_embedding
    from diffulex_edge.gptq import gptq_int4_layers, install_codes
    from diffulex_edge.grid import attach_offsets, find_grid
    from diffulex_edge.split_head import SplitHead, likely_rows, split_rows

    for flag, value in (("clip", clip), ("int8_embedding", int8_embedding)):
        if not isinstance(value, bool):
            raise DiffulexEdgeError(f"{flag} must be True or False, got {value!r}")
    grid = _grid_layers(grid)
    if gptq is not None and not isinstance(gptq, bool):
        raise DiffulexEdgeError(f"gptq must be True, False or None, got {gptq!r}")
    if not clip and calibration is not None:
        raise DiffulexEdgeError("calibration ids are for clip=True; clip=False uses none")
    if (
        isinstance(head_int8_share, bool)
        or not isinstance(head_int8_share, (int, float))
        or not 0 <= head_int8_share < 1
    ):
        raise DiffulexEdgeError(f"head_int8_share must be in [0, 1), got {head_int8_share!r}")
    if not clip and gptq:
        raise DiffulexEdgeError("gptq=True rounds the clipped groups: it needs clip=True")
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_api import Int8DynamicActivationIntxWeightConfig, quantize_

    int8_rows = Int8DynamicActivationIntxWeightConfig(  # 8da8w, one scale per row
        weight_dtype=torch.int8, weight_granularity=PerAxis(0)
    )

    def int8(module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn.rsplit(".", 1)[-1] in int8_layers

    linear_names = {
        fqn.rsplit(".", 1)[-1] for fqn, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    for option, names in (("int8_layers", int8_layers), ("grid", grid)):
        unknown = sorted(set(() if isinstance(names, bool) else names) - linear_names)
        if unknown:
            raise ValueError(
                f"{option} {unknown} name no linear layer; the model has {sorted(linear_names)}"
            )
    int4_layers = {
        fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and not int8(m, fqn)
    }
    for fqn, module in int4_layers.items():
        if module.in_features % group_size:
            raise ValueError(
                f"8da4w needs in_features divisible by group_size {group_size}; "
                f"{fqn} has {module.in_features}"
            )
    grids = {}
    if grid:
        for fqn, module in int4_layers.items():
            if grid is not True and fqn.rsplit(".", 1)[-1] not in grid:
                continue
            found = find_grid(module.weight, group_size)
            if found is not None:
                grids[fqn] = found
    rounded = {fqn: m for fqn, m in int4_layers.items() if fqn not in grids}
    codes = {}
    head_rows = None
    if clip:
        vocab = model.config.vocab_size
        ids = random_ids(vocab) if calibration is None else check_ids(calibration, vocab)
        n_rows = split_rows(vocab, head_int8_share)
        if n_rows and rounded.get("lm_head") is model.lm_head:
            head_rows = likely_rows(model, ids, n_rows)
        if rounded and (gptq or (gptq is None and calibration is not None)):
            codes = gptq_int4_layers(model, rounded, ids, group_size)
        elif rounded:
            clip_int4_layers(model, rounded, ids, group_size)
    codes.update({fqn: (g.codes, g.scales) for fqn, g in grids.items()})
    if head_rows is not None:  # lm_head -> lm_head.int8 (rows) + lm_head.int4 (the rest)
        untie_weight(model, model.lm_head)
        model.lm_head = SplitHead(model.lm_head, head_rows)
        del int4_layers["lm_head"]
        int4_layers["lm_head.int4"] = model.lm_head.int4
        if "lm_head" in codes:
            head_codes, head_scales = codes.pop("lm_head")
            rest = model.lm_head.rest
            codes["lm_head.int4"] = (head_codes[rest], head_scales[rest])
        quantize_(model.lm_head, int8_rows, filter_fn=lambda m, fqn: fqn == "int8")
    if int8_layers:
        quantize_(model, int8_rows, filter_fn=int8)
    quantize_(
        model,
        Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)
        ),
        filter_fn=lambda m, fqn: fqn in int4_layers,
    )
    if codes:
        install_codes(model, codes)
    round_int4_scales(model, int4_layers)  # as XNNPACK stores them (grid and GPTQ: already)
    if grids:
        attach_offsets(model, grids, group_size)
    if int8_embedding:
        quantize_embedding(model)
    return model


def _grid_layers(grid) -> bool | tuple[str, ...]:
    """``quantize_8da4w``'s ``grid`` checked: a bool, or a tuple of layer names."""
    if isinstance(grid, bool):
        return grid
    if isinstance(grid, (tuple, list)) and all(isinstance(name, str) for name in grid):
        return tuple(grid)
    raise DiffulexEdgeError(
        f"grid must be True, False or a tuple of linear layer names, got {grid!r}"
    )


@dataclass(frozen=True)
class ExportResult:
    path: Path
    variant: str
    layout: StaticCacheLayout
    quantize: str | None
    pte_bytes: int
    record_path: Path


def _export_static_kv(graph, layout, prefill_layout):
    """``forward`` of a static_kv graph; with a prefill size, T is dynamic in [1, size]
    (traced at T = size: torch.export specialises a dimension it first sees as 1)."""
    if prefill_layout is None:
        return torch.export.export(graph, graph.example_inputs(layout), strict=False)
    chunk = torch.export.Dim("chunk", min=1, max=prefill_layout.block_size)
    return torch.export.export(
        graph,
        graph.example_inputs(prefill_layout),
        dynamic_shapes=({1: chunk}, None),
        strict=False,
    )


def _export_programs(model: SDARModel, spec: ExportConfig):
    """torch.export of the variant's graph: its methods by name (``forward``, and
    ``prefill`` for a block_kv program with a prefill size), and the edge compile config
    the lowering needs (None for the core-ATen variants)."""
    layout, prefill_layout = spec.layout, spec.prefill_layout
    if spec.variant == "static_kv":
        graph = StaticKVGraph(model, spec.max_seq, layout.block_size).eval()
        from executorch.exir import EdgeCompileConfig  # importable: lowering() ran

        # llama::update_cache / custom_sdpa are not core ATen ops.
        compile_config = EdgeCompileConfig(_check_ir_validity=False)
        return {"forward": _export_static_kv(graph, layout, prefill_layout)}, compile_config
    graph_cls = EXPORT_VARIANTS[spec.variant]
    graph = graph_cls(model).eval()
    programs = {
        "forward": torch.export.export(graph, graph_cls.example_inputs(layout), strict=False)
    }
    if prefill_layout is not None:
        programs[PREFILL_METHOD] = torch.export.export(
            graph, graph_cls.example_inputs(prefill_layout), strict=False
        )
    return programs, None


def _write_program(path: Path, buffer: bytes) -> None:
    """``buffer`` to ``path`` through a temp name in its folder, renamed into place, with the
    mode a plain ``open`` would give (the umask's)."""
    fd, tmp = tempfile.mkstemp(
        dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}."
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buffer)
        os.chmod(tmp, umask_mode())  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def export_pte(
    model: SDARModel,
    path: str | Path,
    max_seq: int,
    block_size: int = 4,
    variant: str = "block_kv",
    quantize: str | None = None,
    prefill_size: int | None = None,
    progress: bool = False,
    calibration=None,
    clip: bool = True,
    int8_embedding: bool = True,
    gptq: bool | None = None,
    grid: bool | tuple[str, ...] = GRID_LAYERS,
    head_int8_share: float = HEAD_INT8_SHARE,
) -> ExportResult:
    """torch.export -> to_edge_transform_and_lower(XnnpackPartitioner) -> .pte at ``path``,
    plus its integrity record ``<path>.json``, which :class:`PteEngine` verifies.

    The arguments are checked first (:class:`~diffulex_edge.export_config.ExportConfig`); a
    toolchain failure propagates. Each file goes to a temp name and is renamed, the program
    first, so a record never describes a program not yet in place.

    Args:
        model: the model to export; left unchanged (quantization works on a copy).
        path: where the program goes; the record goes to ``<path>.json``.
        max_seq: the static KV cache's slots (prompt plus new tokens): a multiple of
            ``block_size``, at most the model's ``max_position_embeddings``.
        block_size: tokens per forward (1 for an autoregressive model).
        variant: the graph, one of :data:`EXPORT_VARIANTS`.
        quantize: None (fp32 weights) or one of :data:`QUANTIZATIONS`.
        prefill_size: causal prompt chunks of up to this many tokens: a second method,
            ``prefill``, with ``block_kv``; ``forward`` itself with ``static_kv`` (which then
            needs ``block_size`` 1). Not for ``cache_io``.
        progress: print a stage bar to stderr.
        calibration: with ``quantize``, the token ids its int4 clipping is calibrated on
            (:func:`quantize_8da4w`); None: random ids of the vocabulary.
        clip: with ``quantize``, False rounds each int4 group min-max, uncalibrated (as
            before 0.11).
        int8_embedding: with ``quantize``, False keeps the embedding table float (as
            before 0.11).
        gptq: with ``quantize``, whether GPTQ chooses the int4 codes (None: with
            ``calibration``; :func:`quantize_8da4w`).
        grid: with ``quantize``, which layers already on a 4-bit grid keep it
            (:func:`quantize_8da4w`; True: every one, as 0.13; False: none, as before 0.13).
        head_int8_share: with ``quantize``, the share of an int4 ``lm_head``'s rows that
            are int8 (:func:`quantize_8da4w`; 0: as before 0.13).

    Returns:
        :class:`ExportResult`: the program's path, variant, cache layout, quantization, size
        in bytes and the record's path.

    Raises:
        DiffulexEdgeError: a bad ``variant``, ``quantize`` or ``prefill_size``, ``max_seq``
            above ``max_position_embeddings``, no ExecuTorch (it names the extra), bad
            calibration ids, or a quantization option without ``quantize``.
        ValueError: ``max_seq`` or ``block_size`` not a positive int, or ``max_seq`` not a
            whole number of blocks.
    """
    spec = ExportConfig(model.config, max_seq, block_size, variant, quantize, prefill_size)
    changed = calibration is not None or gptq is not None
    defaults = (
        clip is True
        and int8_embedding is True
        and grid == GRID_LAYERS
        and head_int8_share == HEAD_INT8_SHARE
    )
    if quantize is None and (changed or not defaults):
        raise DiffulexEdgeError(
            "calibration, clip, int8_embedding, gptq, grid and head_int8_share are options of "
            f"quantize: pass quantize={QUANTIZATIONS[0]!r} (or leave them out for fp32)"
        )
    to_edge_transform_and_lower, XnnpackPartitioner = lowering()
    bar = StageProgress(5 if quantize else 4, enabled=progress)
    if quantize is not None:
        int8_layers = MIXED_INT8_LAYERS if quantize == "8da4w-mixed" else ()
        with bar.stage(f"quantize {quantize}"):
            model = quantize_8da4w(
                copy.deepcopy(model),
                int8_layers=int8_layers,
                calibration=calibration,
                clip=clip,
                int8_embedding=int8_embedding,
                gptq=gptq,
                grid=grid,
                head_int8_share=head_int8_share,
            )
    with bar.stage("torch.export"), torch.no_grad():
        programs, compile_config = _export_programs(model, spec)
    with bar.stage("lower to XNNPACK"):
        edge = to_edge_transform_and_lower(
            programs,
            partitioner=[XnnpackPartitioner()],
            constant_methods=spec.metadata(),
            compile_config=compile_config,
        )
    with bar.stage("serialize"):
        buffer = edge.to_executorch().buffer
    path = Path(path)
    _write_program(path, buffer)
    config = spec.config
    with bar.stage("write"):
        record = write_record(
            path, bytes(buffer), variant, quantize, config, block_size, max_seq, prefill_size or 0
        )
    return ExportResult(path, variant, spec.layout, quantize, len(buffer), record)
