"""The three SmolLM2 packages stacked (membound_integration.stack): the model built from
storage by paired-cache's ``load_sparse`` (every MLP a SparseMLP at 50% rows, the trained
predictor's rows multiplied in place in the mapped pool), zstd-linear's ``load_compressed``
of every attention projection and the tied embedding (``budget(memory_limit="auto")``, as
the zstd-linear row), and bmrt-kv bounding the KV cache below the sequence's length.

Nothing of the model is materialised in anonymous memory. The bounded component is what
the three single-package rows report together: the MLP rows' bytes a token multiplies, the
attention and embedding weights resident (compressed, plus what the policy keeps decoded),
and the KV cache.
"""

from membound_integration.row import QUESTION, Row, greedy_generate
from membound_integration.rows.paired_cache import pool_path, predictor_path

FRACTION = 0.5
BUDGET = 32
BLOCK = 16


def rest_zlin_path():
    """The SmolLM2 .zlin file without the MLPs (attention projections and the tied
    embedding), cut from the whole model's file."""
    from membound_integration.smollm2_zlin import compressed_smollm2_path
    from membound_integration.stack import write_rest_zlin

    full = compressed_smollm2_path()
    path = full.with_name(full.stem + "-no-mlp.zlin")
    if not path.is_file():
        write_rest_zlin(full, path)
    return path


def combined_row() -> Row:
    from transformers import PreTrainedTokenizerFast

    from bmrt_kv import BMRTCache, BMRTConfig
    from membound_integration.stack import load_stacked
    from membound_testing import chat_prompt, smollm2_float_dir
    from paired_cache.pool_file import PoolFile
    from zstd_linear import compression_report, compression_stats, reset_stats

    model_dir = smollm2_float_dir()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    model = load_stacked(
        model_dir,
        pool_path(),
        rest_zlin_path(),
        "trained",
        FRACTION,
        predictor=predictor_path(),
        policy="budget",
        memory_limit="auto",
    )
    config = model.config
    report = compression_report(model)
    reset_stats(model)
    cache = BMRTCache(
        model, BMRTConfig(budget=BUDGET, protection_divisor=4, block_size=BLOCK, selector="snapkv")
    )
    prompt = chat_prompt(tokenizer, QUESTION)
    gen = greedy_generate(model, tokenizer, prompt, past_key_values=cache, prefill_chunk_size=BLOCK)
    stats = compression_stats(model)
    mlps = [layer.mlp for layer in model.model.layers]
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    seen = cache.get_seq_length()
    mlp_bytes = PoolFile(pool_path()).pool_bytes + sum(m.gate_weight.nbytes for m in mlps)
    resident = (
        sum(m.cache.active_bytes for m in mlps)
        + report.compressed_bytes
        + stats.peak_decoded_bytes
        + cache.peak_kv_bytes()
    )
    return Row(
        name=(
            f"stacked: paired-cache {round(FRACTION * 100)}% rows in place + zstd-linear "
            f"attention and embedding (ratio {report.ratio:.2f}) + bmrt-kv B={BUDGET} "
            f"({seen} tokens)"
        ),
        **gen.row_fields(),
        component="MLP rows read + attention, embedding + KV",
        resident_bytes=resident,
        unbounded_bytes=mlp_bytes + report.original_bytes + seen * per_token,
    )


ROWS = {"combined": combined_row}
PREPARE = [pool_path, predictor_path, rest_zlin_path]
