"""The three SmolLM2 packages stacked (membound_integration.stack): the model built from
storage by paired-cache's ``load_sparse`` (every MLP a SparseMLP at 50% rows over a
grid pool: each neuron's up and down_T rows as the Q4_1 codes SmolLM2's float copy was
dequantized from, 648 bytes a row, and a token decodes the rows the trained predictor
picked, bit for bit), zstd-linear's ``load_compressed`` of every
attention projection, every MLP's gate (the predictor reads all of it every token) and
the tied embedding (``budget(memory_limit="auto")``, as the zstd-linear row), and bmrt-kv
bounding the KV cache to a budget sized to the limit (``stack.kv_budget``): 32 tokens,
below the sequence's 61, where the limit leaves nothing (``tight``, ``mid``).

With memory to spare (what zstd-linear's budget policy leaves of the limit,
``stack.room_left``), the KV budget grows to the whole sequence (it then never
compresses), and paired-cache keeps the rows of as many layers decompressed as fit in
the rest (``keep_decoded``, ``stack.room_for_rows``): a kept row is read and decompressed
once, not at every token. Under ``tight`` nothing is left and none is kept.

paired-cache's page keeper keeps nothing cached (``keep_cached=0``): its "auto" sizes what it keeps
against the cgroup's room without seeing what zstd-linear decodes into the same room,
and under ``tight`` the stack then read 364 MiB per token (float32 pool) against 334 with
nothing kept (tests-integration/benchmarks/stack_pools.py compares them; the
MEMBOUND_STACK_POOL / _KEEP / _POLICY / _DECODE_BLOCK / _KV variables pick the variants it measures).

Nothing of the model is materialised in anonymous memory. The bounded component is what
the three single-package rows report together: the MLP rows' bytes a token multiplies, the
attention, gate and embedding weights resident (compressed, plus what the policy keeps
decoded), and the KV cache.
"""

import os

from membound_integration.row import QUESTION, Row, greedy_generate
from membound_integration.rows.paired_cache import pool_path, predictor_path

FRACTION = 0.5
# bmrt-kv's budget: at least BUDGET tokens, and the whole sequence where a quarter of what
# the limit leaves holds its keys and values (stack.kv_budget): under tight and mid
# nothing is left and the cache compresses to 32 tokens at every step; under ample it
# holds the sequence's 61 tokens (2.7 MiB) and never compresses, as zstd-linear then pins
# every layer and paired-cache keeps every row decoded. MEMBOUND_STACK_KV=fixed keeps
# BUDGET under every limit (compressing cost 15-20 ms a step at ample, 2026-12-07).
BUDGET = 32
KV_FROM_LIMIT = os.environ.get("MEMBOUND_STACK_KV", "limit") != "fixed"
BLOCK = 16
MAX_NEW_TOKENS = 24
# bmrt-kv's decode_block: decoding steps compressed together (1: every step). 16 made a
# decoding step faster (61-62 ms against 72-80, no limit) but changed the greedy answer
# to a shorter one ("Paris, France.", 10 tokens against 24), and the rows' tokens/s
# count the prompt's prefill over the answer's tokens: under tight it measured 0.81
# tok/s against 0.95 with 1 (2026-12-07, one run each).
DECODE_BLOCK = int(os.environ.get("MEMBOUND_STACK_DECODE_BLOCK", "1"))
# The pool the stacked row reads: "grid" (each row the Q4_1 codes SmolLM2's float copy
# was dequantized from, decoded bit for bit), "zstd" (each row a zstd frame) or "float32"
# (the gate-less pool of the paired-cache row).
POOL = os.environ.get("MEMBOUND_STACK_POOL", "grid")
COMPRESSED_POOLS = ("grid", "zstd")
# paired-cache's keep_cached: a byte count, "auto" or "none".
_KEEP = os.environ.get("MEMBOUND_STACK_KEEP", "0")
KEEP_CACHED = int(_KEEP) if _KEEP.isdigit() else {"auto": "auto", "none": None}[_KEEP]
# paired-cache's keep_decoded: "auto" (stack.room_for_rows), a byte count or "none".
_DECODED = os.environ.get("MEMBOUND_STACK_DECODED", "auto")
KEEP_DECODED = int(_DECODED) if _DECODED.isdigit() else {"auto": "auto", "none": None}[_DECODED]
# zstd-linear's policy for the attention, gates and embedding. One slab (window=1): under
# tight the weights' reads bound the speed and decoding a layer ahead gained nothing (0.942
# tok/s with 1, 0.938 with 2, one run each, 2026-12-07), while its slab (the gate's 3.4
# MiB) is anonymous memory a hard limit takes from the page cache. With room (mid, ample)
# the budget pins the layers and the window is not used.
POLICY = {
    "budget": {"policy": "budget", "memory_limit": "auto", "window": 1},
    "per_pass_prefetch": {"policy": "per_pass_prefetch"},
}[os.environ.get("MEMBOUND_STACK_POLICY", "budget")]


def compressed_pool_path(codec: str | None = None):
    """The SmolLM2 compressed pool file of ``codec`` (default: POOL's; ``convert(...,
    compress=codec)``: no gate, each row a zstd frame or grid codes), written on first
    use."""
    import paired_cache
    from membound_testing import smollm2_float_dir
    from paired_cache.model_io import convert

    codec = codec or POOL
    source = smollm2_float_dir()
    path = source.parent / f"{source.name}-paired-cache-{paired_cache.__version__}-{codec}.pcpool"
    if not path.is_file():
        convert(source, path, compress=codec, progress=False)  # written atomically
    return path


def rest_zlin_path():
    """The SmolLM2 .zlin file of the attention projections, the MLPs' gates and the tied
    embedding, cut from the whole model's file."""
    from membound_integration.smollm2_zlin import compressed_smollm2_path
    from membound_integration.stack import write_rest_zlin

    full = compressed_smollm2_path()
    path = full.with_name(full.stem + "-no-rows.zlin")
    if not path.is_file():
        write_rest_zlin(full, path, gate=True)
    return path


def combined_row() -> Row:
    from transformers import PreTrainedTokenizerFast

    from bmrt_kv import BMRTCache, BMRTConfig
    from membound_integration.stack import (
        HEADROOM,
        kv_budget,
        kv_bytes_per_token,
        load_stacked,
        room_for_rows,
    )
    from membound_testing import chat_prompt, smollm2_float_dir
    from paired_cache.compressed_mlp import keep_decoded
    from zstd_linear import compression_report, compression_stats, reset_stats

    model_dir = smollm2_float_dir()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    model = load_stacked(
        model_dir,
        compressed_pool_path() if POOL in COMPRESSED_POOLS else pool_path(),
        rest_zlin_path(),
        "trained",
        FRACTION,
        predictor=predictor_path(),
        keep_cached=KEEP_CACHED,
        **POLICY,
    )
    config = model.config
    prompt = chat_prompt(tokenizer, QUESTION)
    sequence = len(tokenizer(prompt).input_ids) + MAX_NEW_TOKENS
    # The KV first (a few MiB), then the rows kept decoded in what is left.
    budget = kv_budget(model, sequence, BUDGET) if KV_FROM_LIMIT else BUDGET
    if POOL in COMPRESSED_POOLS and KEEP_DECODED is not None:
        reserve = HEADROOM + budget * kv_bytes_per_token(config)
        keep_decoded(
            model, room_for_rows(model, reserve) if KEEP_DECODED == "auto" else KEEP_DECODED
        )
    report = compression_report(model)
    reset_stats(model)
    cache = BMRTCache(
        model,
        BMRTConfig(
            budget=budget,
            protection_divisor=4,
            block_size=BLOCK,
            selector="snapkv",
            decode_block=DECODE_BLOCK,
        ),
    )
    # Blocks of BLOCK tokens where the prompt compresses; one forward where it never does.
    chunks = {"prefill_chunk_size": BLOCK} if budget < sequence else {}
    gen = greedy_generate(model, tokenizer, prompt, MAX_NEW_TOKENS, past_key_values=cache, **chunks)
    stats = compression_stats(model)
    mlps = [layer.mlp for layer in model.model.layers]
    seen = cache.get_seq_length()
    # Unbounded: the MLPs' up and down in float32 (the gates are in the report's bytes).
    rows_bytes = config.num_hidden_layers * 2 * config.hidden_size * config.intermediate_size * 4
    resident = (
        # In place, a compressed pool's SparseMLP keeps only the rows keep_decoded kept.
        sum(m.cache.active_bytes for m in mlps if hasattr(m, "cache"))
        + sum(m.kept_rows * m.frames.frame_size for m in mlps if hasattr(m, "kept_rows"))
        + report.compressed_bytes
        + stats.peak_decoded_bytes
        + cache.peak_kv_bytes()
    )
    return Row(
        name=(
            f"stacked: paired-cache {round(FRACTION * 100)}% rows in place from a {POOL} pool + "
            f"zstd-linear attention, gates and embedding (ratio {report.ratio:.2f}) + bmrt-kv "
            f"B={budget}{f', decode_block={DECODE_BLOCK}' if DECODE_BLOCK > 1 else ''} "
            f"({seen} tokens; B sized to the limit, {BUDGET} at the least)"
        ),
        **gen.row_fields(),
        component="MLP rows read + attention, gates, embedding + KV",
        resident_bytes=resident,
        unbounded_bytes=rows_bytes + report.original_bytes + seen * kv_bytes_per_token(config),
    )


ROWS = {"combined": combined_row}
PREPARE = [compressed_pool_path, predictor_path, rest_zlin_path]
