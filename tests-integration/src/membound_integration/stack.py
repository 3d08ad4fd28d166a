"""The packages stacked on one model, each through its own public API (#54).

No package imports another; this module is the glue, and it is short because each package
takes the model the other left:

1. ``paired_cache.load_sparse`` builds the model from storage: every MLP a SparseMLP over
   the rows of a pool file, mapped (``rows="in_place"``: each token multiplies its
   predicted rows where they lie; a compressed pool, ``convert(..., compress=True)``,
   holds each row as a zstd frame and a token decompresses its picked rows only), every
   other weight a view of the mapped safetensors. The SparseMLP keeps the gate as its own
   ``gate_proj`` Linear, which the mask source calls.
2. ``zstd_linear.load_compressed(path, model)`` replaces every nn.Linear the .zlin file
   names and the embedding (with the lm_head tied to it) by their compressed forms, still
   file-backed: the attention projections and, with ``gate=True``, each SparseMLP's
   gate_proj (the gated mask sources read the whole gate every token, so it is read
   compressed). The file is written without the rows the pool holds
   (``compress_model(model, exclude=ROWS_GLOBS, embeddings=True)``, or :func:`write_rest_zlin`).
3. ``bmrt_kv.BMRTCache`` bounds the KV cache of that model's attention.
4. With memory to spare, ``paired_cache.compressed_mlp.keep_decoded`` keeps the rows of
   some layers decompressed once read (:func:`room_for_rows` sizes them from what
   zstd-linear's budget policy left: both packages draw on one limit, so the second one
   sized is given what the first did not take).

Nothing of the model is copied into anonymous memory but the mask sources' predictors,
the MLP rows a token multiplies, the decoded layers the zstd-linear policy keeps and the
rows paired-cache keeps decoded.

Stacking in the other order (compress first, then sparsify) gives the same model at
lossless settings (tests/test_stack.py); a file naming layers another package replaced
is refused by zstd-linear before the model changes.
"""

from __future__ import annotations

import os
from pathlib import Path

MLP_GLOB = "*.mlp.*"  # every MLP layer: the .zlin of a stack whose pool holds the gate
ROWS_GLOBS = ("*.mlp.up_proj", "*.mlp.down_proj")  # what a gate-less pool holds
HEADROOM = 64 << 20  # bytes of a limit kept back for activations (room_left)


def write_rest_zlin(full: str | os.PathLike, path: str | os.PathLike, gate: bool = True) -> Path:
    """Cut the .zlin file of every layer but the pool's rows from a file of the whole
    model, with zstd-linear's own reader and writer (no re-encoding; written atomically).

    Args:
        full: a .zlin file written by ``save_compressed`` of the whole model.
        path: where to write the cut file.
        gate: keep the MLPs' gate_proj layers (for a gate-less or compressed pool, whose
            SparseMLPs hold the gate as their ``gate_proj`` Linear); False drops every MLP
            layer.

    Returns:
        ``path``.
    """
    from zstd_linear.fileformat import read_file, write_file

    def kept(name: str) -> bool:
        return ".mlp." not in name or (gate and name.endswith(".mlp.gate_proj"))

    entries = read_file(full)
    write_file(path, [e for e in entries if kept(e[0])])
    return Path(path)


def load_stacked(
    model_dir: str | os.PathLike,
    pool: str | os.PathLike,
    zlin: str | os.PathLike,
    source: str = "trained",
    fraction: float = 0.5,
    *,
    policy: str = "per_pass_prefetch",
    predictor: str | os.PathLike | None = None,
    keep_cached: int | str | None = "auto",
    keep_decoded: int | str | None = None,
    **policy_options,
):
    """The model of ``model_dir`` with its MLPs sparse over ``pool`` and every other Linear
    and the embedding compressed from ``zlin``.

    Args:
        model_dir: a transformers checkpoint (config.json and safetensors).
        pool: its pool file (``paired_cache.convert``).
        zlin: its .zlin file without the pool's rows (``compress_model(...,
            exclude=ROWS_GLOBS, embeddings=True)`` then ``save_compressed``, or
            :func:`write_rest_zlin`).
        source: paired-cache's mask source; "trained" needs ``predictor``.
        fraction: the share of MLP rows each token reads, in (0, 1].
        policy: zstd-linear's policy name; ``policy_options`` go to it (``memory_limit=
            "auto"`` for "budget").
        predictor: the predictor file of ``source="trained"``.
        keep_cached: ``load_sparse``'s (what each token reads in full that stays cached).
        keep_decoded: bytes of decoded MLP rows to keep (a compressed pool only:
            ``paired_cache.compressed_mlp.keep_decoded``), "auto" for
            :func:`room_for_rows` (with ``policy="budget"``), or None (keep none).

    Returns:
        The model, in eval mode.
    """
    import zstd_linear
    from paired_cache import load_sparse

    options = {} if predictor is None else {"predictor": predictor}
    model = load_sparse(
        model_dir, pool, source, fraction, rows="in_place", keep_cached=keep_cached, **options
    )
    zstd_linear.load_compressed(zlin, model, policy, **policy_options)
    if keep_decoded is not None:
        from paired_cache.compressed_mlp import keep_decoded as keep

        keep(model, room_for_rows(model) if keep_decoded == "auto" else keep_decoded)
    return model


def room_left(model, headroom: int = HEADROOM) -> int:
    """The bytes zstd-linear's budget policy left of its ``memory_limit`` (what its pinned
    set does not charge), less ``headroom`` kept back for activations; what the other
    packages of the stack (kept rows, the KV cache) may take. 0 when the policy is not
    "budget" (it then says nothing of the limit); negative where even the headroom does
    not fit.

    Args:
        model: a stacked model (:func:`load_stacked`).
        headroom: bytes kept back.
    """
    from zstd_linear.model import runtime_of
    from zstd_linear.policies.budget import Budget

    policy = runtime_of(model).policy
    if not isinstance(policy, Budget):
        return 0
    encoded = policy.store.encoded
    if policy.memory_limit is None:  # budget_bytes given: decoded bytes, all charged
        charged = sum(encoded[n].original_bytes for n in policy.pinned)
    else:
        charged = sum(
            max(0, encoded[n].original_bytes - encoded[n].file_backed_bytes) for n in policy.pinned
        )
    return policy.budget_bytes - charged - headroom


def kv_bytes_per_token(config) -> int:
    """Bytes of float32 keys and values one token adds to a transformers model's KV cache
    (every layer, every KV head).

    Args:
        config: the model's transformers config.
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * 4


def kv_budget(model, tokens: int, floor: int, headroom: int = HEADROOM) -> int:
    """A bmrt-kv token budget for a stacked model under its limit: ``tokens`` (the longest
    sequence the caller will run, which then never compresses) where a quarter of what
    the limit leaves (:func:`room_left`) holds their keys and values, else as many as it
    holds, and never fewer than ``floor``: the KV is bounded by what the limit leaves,
    as zstd-linear pins and paired-cache keeps what it leaves.

    Args:
        model: a stacked model (:func:`load_stacked`).
        tokens: the longest sequence (prompt and generated tokens) to be run.
        floor: the smallest budget (the one the tightest limit gets).
        headroom: as :func:`room_left`'s.

    Returns:
        A budget for ``BMRTConfig(budget=...)``.
    """
    share = max(0, room_left(model, headroom)) // 4
    return max(floor, min(tokens, share // kv_bytes_per_token(model.config)))


def room_for_rows(model, headroom: int = HEADROOM) -> int:
    """The bytes of decoded MLP rows a stacked model may keep (``keep_decoded``) in what
    zstd-linear's budget policy left of its ``memory_limit``.

    The budget policy sized its pinned set to the limit less what the process held, its
    prefetch buffers, a headroom and every compressed byte it maps (kept in the page
    cache); what its pinned set does not charge is left. Of that, a layer whose rows are
    kept costs its decoded bytes, and a layer not kept needs its compressed pool pages
    cached (else every token reads them from storage): as many layers are kept as leave
    the rest's pages room, or, where even none kept would not leave them room (the
    pool is read from storage every token anyway), as many as the bytes hold. Another
    ``headroom`` is kept back for activations.

    Args:
        model: a stacked model (:func:`load_stacked`) over a compressed pool.
        headroom: bytes left over besides.

    Returns:
        A byte count for ``keep_decoded``; 0 when zstd-linear's policy is not "budget"
        (it then says nothing of the limit).
    """
    from paired_cache.compressed_mlp import CompressedSparseMLP

    mlps = [m for m in model.modules() if isinstance(m, CompressedSparseMLP)]
    if not mlps:
        return 0
    left = room_left(model, headroom)
    decoded = mlps[0].decoded_bytes
    packed = sum(m.frames.total_bytes for m in mlps) / len(mlps)
    n = len(mlps)
    if left <= 0:
        return 0
    if left >= n * packed:  # keep k with k * decoded + (n - k) * packed <= left
        k = int((left - n * packed) // max(1.0, decoded - packed))
    else:
        k = int(left // decoded)
    return min(n, k) * decoded
