"""Compressing a whole model: select Linear layers, swap them, attach the runtime."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatchcase

import torch.nn as nn

from zstd_linear.codec import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_LAYOUT,
    DEFAULT_RAW_BELOW,
    CodecConfig,
    encode_weight,
)
from zstd_linear.decoder import check_threads
from zstd_linear.embedding import CompressedEmbedding
from zstd_linear.errors import ZstdLinearError
from zstd_linear.guards import guard, unguard
from zstd_linear.layer import CompressedLinear
from zstd_linear.layout import SUPPORTED_DTYPES, dtype_name
from zstd_linear.policies import check_policy
from zstd_linear.progress import ProgressBar
from zstd_linear.report import CompressionReport, LayerReport
from zstd_linear.runtime import ModelRuntime
from zstd_linear.stats import DecodeStats

RUNTIME_ATTR = "zstd_linear_runtime"
# compress_model draws its progress bar by default from this many bytes of weights on
# (~10 s of encoding: the optimal parser runs at ~10 MB/s per core).
PROGRESS_MIN_BYTES = 64 << 20


def _patterns(value, param: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    items = list(value)
    if not all(isinstance(v, str) for v in items):
        raise ZstdLinearError(f"{param} must be a glob string or a list of them, got {value!r}")
    return items


def _tied_names(model: nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    return owners


def select_linears(
    model: nn.Module, include=None, exclude=None
) -> tuple[list[str], dict[str, str]]:
    """Fully qualified names of the nn.Linear layers to compress, and name -> reason for
    Linear layers left plain. Every ``include`` glob must match an nn.Linear."""
    inc = _patterns(include, "include")
    exc = _patterns(exclude, "exclude")
    modules = dict(model.named_modules())
    for pattern in inc:
        hits = [n for n in modules if fnmatchcase(n, pattern)]
        if not any(isinstance(modules[n], nn.Linear) for n in hits):
            kinds = sorted({type(modules[n]).__name__ for n in hits}) or ["nothing"]
            raise ZstdLinearError(
                f"include pattern {pattern!r} must match an nn.Linear, it matches {kinds}"
            )
    owners = _tied_names(model)
    chosen, skipped = [], {}
    for name, module in modules.items():
        if not isinstance(module, nn.Linear):
            continue
        if inc and not any(fnmatchcase(name, p) for p in inc):
            continue
        if any(fnmatchcase(name, p) for p in exc):
            continue
        others = [n for n in owners[id(module.weight)] if n != f"{name}.weight"]
        if others:
            # A tied weight (lm_head = embed_tokens) stays plain for its other owner,
            # so compressing this copy would add bytes and decode time, not save any.
            skipped[name] = f"weight tied to {', '.join(others)}"
            continue
        if module.weight.dtype not in {t for t, _ in SUPPORTED_DTYPES.values()}:
            raise ZstdLinearError(
                f"layer {name!r} has dtype {module.weight.dtype}; supported: "
                f"{sorted(SUPPORTED_DTYPES)}"
            )
        if module.weight.device.type != "cpu":
            raise ZstdLinearError(f"layer {name!r} must be on the CPU, got {module.weight.device}")
        chosen.append(name)
    if not chosen:
        raise ZstdLinearError(f"no nn.Linear to compress (include={inc}, exclude={exc})")
    return chosen, skipped


def check_uncompressed(model) -> None:
    """ZstdLinearError unless ``model`` is an nn.Module that is not compressed yet."""
    if not isinstance(model, nn.Module):
        raise ZstdLinearError(f"model must be an nn.Module, got {type(model).__name__}")
    if RUNTIME_ATTR in model.__dict__:
        raise ZstdLinearError("model is already compressed: call decompress_model first")


def runtime_of(model: nn.Module) -> ModelRuntime:
    """The runtime attached to ``model``; ZstdLinearError if it is not compressed."""
    runtime = model.__dict__.get(RUNTIME_ATTR)
    if runtime is None:
        raise ZstdLinearError("model is not compressed: call compress_model or load_compressed")
    return runtime


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def tied_to(model: nn.Module, embedding_name: str) -> list[str]:
    """Names of the nn.Linear modules whose weight is the embedding's parameter."""
    owners = _tied_names(model)
    weight = model.get_submodule(embedding_name).weight
    names = [n.removesuffix(".weight") for n in owners[id(weight)]]
    return [n for n in names if isinstance(model.get_submodule(n), nn.Linear)]


def own_forward(module: nn.Module) -> str | None:
    """Why an nn.Embedding cannot become a CompressedEmbedding: its class overrides
    nn.Embedding's lookup (Gemma's ScaledWordEmbedding scales the rows, OPT's
    LearnedPositionalEmbedding takes positions); None for a plain lookup."""
    if type(module).forward is nn.Embedding.forward:
        return None
    return f"{type(module).__name__} has its own forward, not nn.Embedding's lookup"


def select_embeddings(model: nn.Module, skipped: dict[str, str]) -> list[str]:
    """Fully qualified names of the nn.Embedding tables to compress, each checked; an
    embedding with its own forward is added to ``skipped`` (name -> reason) instead."""
    tables = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            reason = own_forward(module)
            if reason is None:
                tables.append(name)
            else:
                # Left plain, with the Linear tied to it (skipped above): compressing the
                # table alone would drop what its forward does (a scale: other logits).
                skipped[name] = reason
    for name in tables:
        check_embedding(name, model.get_submodule(name))
    return tables


def check_embedding(name: str, module: nn.Module) -> None:
    if module.max_norm is not None:
        raise ZstdLinearError(
            f"embedding {name!r} has max_norm (it renormalises rows): not supported"
        )
    if module.weight.device.type != "cpu":
        raise ZstdLinearError(f"embedding {name!r} must be on the CPU, got {module.weight.device}")
    if module.weight.numel() == 0:
        raise ZstdLinearError(f"embedding {name!r} is empty")
    dtype_name(module.weight.dtype)


def install(
    model: nn.Module,
    layers: dict[str, CompressedLinear],
    policy: str,
    threads: int | None,
    policy_options: dict,
    embeddings: dict[str, CompressedEmbedding] | None = None,
) -> ModelRuntime:
    """Swap ``layers`` (fqn -> CompressedLinear) and ``embeddings`` (fqn ->
    CompressedEmbedding) into ``model`` and attach the runtime."""
    if RUNTIME_ATTR in model.__dict__:
        raise ZstdLinearError("model is already compressed: call decompress_model first")
    runtime = ModelRuntime(
        layers, policy=policy, threads=threads, embeddings=embeddings, **policy_options
    )
    for name, module in {**layers, **(embeddings or {})}.items():
        _swap(model, name, module)
    runtime.attach(model)
    guard(model)
    model.__dict__[RUNTIME_ATTR] = runtime
    return runtime


def report_of(layers: Iterable, skipped: dict[str, str]) -> CompressionReport:
    """layers: the stored CompressedLinear / CompressedEmbedding modules."""
    return CompressionReport(
        layers=[
            LayerReport(
                name=lyr.name,
                dtype=lyr.encoded.dtype,
                shape=lyr.encoded.shape,
                layout=lyr.encoded.layout,
                original_bytes=lyr.encoded.original_bytes,
                compressed_bytes=lyr.encoded.compressed_bytes,
                file_backed_bytes=lyr.encoded.file_backed_bytes,
            )
            for lyr in layers
        ],
        skipped=dict(skipped),
    )


def compress_model(
    model: nn.Module,
    include: str | Iterable[str] | None = None,
    exclude: str | Iterable[str] | None = None,
    level: int = 3,
    policy: str = "per_pass_prefetch",
    *,
    layout: str = DEFAULT_LAYOUT,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    raw_below: float = DEFAULT_RAW_BELOW,
    threads: int | None = None,
    progress: bool | None = None,
    embeddings: bool = False,
    **policy_options,
) -> CompressionReport:
    """Replace ``model``'s nn.Linear layers by CompressedLinear, in place.

    Each weight is encoded losslessly (outputs stay bit-identical) and decoded on
    demand; a runtime attached to ``model`` counts its forward passes and serves the
    weights through the caching policy. Everything is validated before the model
    changes.

    Args:
        model: any nn.Module; its Linear weights float32, bfloat16 or float16, on the
            CPU.
        include: glob(s) over fully qualified module names; each must match an
            nn.Linear. Default: every Linear.
        exclude: glob(s) of Linear layers to leave plain.
        level: zstd level, 1..22.
        policy: a ``POLICIES`` name: ``"none"``, ``"per_pass"``,
            ``"per_pass_prefetch"``, ``"budget"`` or ``"resident"``.
        layout: how a weight's bytes are split into planes (``zstd_linear.layout.
            LAYOUTS``, or ``"auto"``: per dtype); see ``zstd_linear.codec.CodecConfig``.
        chunk_bytes: bytes of weight per independently decoded chunk (>= 4096).
        raw_below: a plane is stored raw or bit-packed when zstd saves less than this
            share of it, in [0, 1).
        threads: decode and compression threads (default min(2, cores)).
        progress: a bar on stderr, drawn before the first layer is encoded. None: on
            when the weights to encode exceed ``PROGRESS_MIN_BYTES`` (64 MiB, about
            10 s at ~10 MB/s per core).
        embeddings: also compress every plain nn.Embedding (into CompressedEmbedding);
            a Linear tied to one (SmolLM2's lm_head) becomes a CompressedLinear over
            the same frames, stored once. An embedding whose class has its own forward
            (Gemma's scaled one, OPT's positions) stays plain, with any Linear tied to
            it, and is listed in ``report.skipped``.
        **policy_options: passed to the policy: ``window`` (per_pass_prefetch, budget);
            ``budget_bytes`` or ``memory_limit`` (an int or ``"auto"``), and
            ``headroom_bytes`` (budget).

    Returns:
        CompressionReport: one LayerReport per stored weight (sizes, ratio) and
        ``skipped``, name -> why a Linear or embedding stayed plain (a tied weight).

    Raises:
        ZstdLinearError: a bad argument (a policy name or option, a level, a glob that
            matches no Linear, an unsupported dtype or device, nothing to compress) or
            a model that is already compressed; ``model`` is unchanged.
    """
    check_uncompressed(model)
    config = CodecConfig(level=level, layout=layout, chunk_bytes=chunk_bytes, raw_below=raw_below)
    threads = check_threads(threads)
    check_policy(policy)
    names, skipped = select_linears(model, include, exclude)
    tables = select_embeddings(model, skipped) if embeddings else []
    modules = {name: model.get_submodule(name) for name in names + tables}
    if progress is None:
        progress = sum(m.weight.nbytes for m in modules.values()) >= PROGRESS_MIN_BYTES
    layers, compressed_tables = _encode(modules, config, threads, progress)
    for name, table in compressed_tables.items():
        for head in tied_to(model, name):
            layers[head] = CompressedLinear(table.encoded, model.get_submodule(head).bias, head)
            skipped.pop(head, None)
    install(model, layers, policy, threads, policy_options, compressed_tables)
    return report_of(model.__dict__[RUNTIME_ATTR].stored_weights(), skipped)


def _encode(
    modules: dict[str, nn.Module], config: CodecConfig, threads: int, progress: bool
) -> tuple[dict[str, CompressedLinear], dict[str, CompressedEmbedding]]:
    """Encode ``modules`` (fqn -> nn.Linear or nn.Embedding) into CompressedLinear and
    CompressedEmbedding modules; the model is not touched."""
    bar = ProgressBar(len(modules)) if progress else None
    layers: dict[str, CompressedLinear] = {}
    tables: dict[str, CompressedEmbedding] = {}
    # Layers are encoded concurrently (zstd releases the GIL), in order for the bar.
    with ThreadPoolExecutor(threads) as pool:
        encoded = pool.map(lambda m: encode_weight(m.weight, config), modules.values())
        for (name, module), enc in zip(modules.items(), encoded, strict=True):
            if isinstance(module, nn.Embedding):
                tables[name] = CompressedEmbedding(enc, name, module.padding_idx)
            else:
                layers[name] = CompressedLinear(enc, module.bias, name)
            if bar is not None:
                bar.advance(name)
    return layers, tables


def decompress_model(model: nn.Module) -> nn.Module:
    """Put plain nn.Linear (and nn.Embedding) modules back, in place, and detach the
    runtime. The weights are bit-identical to the compressed ones; a tied lm_head is
    tied to the restored embedding again.

    Args:
        model: a model compressed by ``compress_model`` or ``load_compressed``.

    Returns:
        ``model`` itself, uncompressed.

    Raises:
        ZstdLinearError: ``model`` is not compressed.
    """
    runtime = runtime_of(model)
    unguard(model)
    tables = {}
    for name, table in runtime.embeddings.items():
        restored = nn.Embedding(
            table.num_embeddings,
            table.embedding_dim,
            padding_idx=table.padding_idx,
            _weight=table.weight,
            _freeze=False,
        )
        tables[id(table.encoded)] = restored.weight
        _swap(model, name, restored)
    decoded = {}
    for name, layer in runtime.layers.items():
        # A tied lm_head takes the restored table itself (no second decode).
        tied = tables.get(id(layer.encoded))
        decoded[name] = layer.weight if tied is None else tied
    runtime.close()
    for name, layer in runtime.layers.items():
        weight = decoded[name]
        linear = nn.Linear(
            layer.in_features,
            layer.out_features,
            bias=layer.bias is not None,
            dtype=weight.dtype,
            device="meta",
        )
        # A tied lm_head gets the restored embedding's parameter itself: tied again.
        linear.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        if layer.bias is not None:
            linear.bias = nn.Parameter(layer.bias.detach())
        _swap(model, name, linear)
    del model.__dict__[RUNTIME_ATTR]
    return model


def set_policy(model: nn.Module, policy: str, **policy_options) -> None:
    """Switch a compressed model's caching policy; every decoded weight is dropped.

    Args:
        model: a compressed model.
        policy: a ``POLICIES`` name.
        **policy_options: the policy's options, as for ``compress_model``.

    Raises:
        ZstdLinearError: ``model`` is not compressed, or a bad policy name or option;
            the old policy stays in place.
    """
    runtime_of(model).set_policy(policy, **policy_options)


def compression_stats(model: nn.Module) -> DecodeStats:
    """The live counters of a compressed model's decoding work.

    Args:
        model: a compressed model.

    Returns:
        DecodeStats (``zstd_linear.stats``): forward passes, decompressions, bytes and
        seconds decoding, decoded bytes held now and at peak, compressed bytes split
        into anonymous and file-backed. The same object keeps counting.

    Raises:
        ZstdLinearError: ``model`` is not compressed.
    """
    return runtime_of(model).stats


def reset_stats(model: nn.Module) -> None:
    """Zero a compressed model's counters; the decoded bytes held now become the peak.

    Args:
        model: a compressed model.

    Raises:
        ZstdLinearError: ``model`` is not compressed.
    """
    runtime_of(model).reset_stats()


def compression_report(model: nn.Module) -> CompressionReport:
    """What a compressed model stores, as ``load_compressed(path, model)`` reports it.

    Args:
        model: a compressed model.

    Returns:
        CompressionReport: one LayerReport per stored weight (a tied lm_head shares its
        embedding's); ``skipped`` is empty.

    Raises:
        ZstdLinearError: ``model`` is not compressed.
    """
    return report_of(runtime_of(model).stored_weights(), {})


def compressed_layers(model: nn.Module) -> dict[str, CompressedLinear]:
    """The compressed Linear layers of a model.

    Args:
        model: a compressed model.

    Returns:
        Fully qualified name -> CompressedLinear, a tied lm_head included.

    Raises:
        ZstdLinearError: ``model`` is not compressed.
    """
    return dict(runtime_of(model).layers)
