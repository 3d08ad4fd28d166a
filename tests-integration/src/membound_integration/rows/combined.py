"""All three SmolLM2 packages at once: paired-cache SparseMLP (50% rows per token) in every
MLP, zstd-linear (per_pass_prefetch) on every attention projection, and bmrt-kv bounding the
KV cache below the sequence's length.

The MLPs are sparsified first (their weights move into the PairedCache pools), then the
attention projections are loaded compressed from a .zlin file: zstd-linear compresses only
what is still an nn.Linear. The bounded component is the sum of the three components the
single-package rows report: MLP weights read per token, attention Linear weights resident,
and the KV cache.
"""

from membound_integration.row import QUESTION, Row, greedy_generate

FRACTION = 0.5
BUDGET = 32
BLOCK = 16


def combined_row() -> Row:
    from bmrt_kv import BMRTCache, BMRTConfig
    from membound_integration.smollm2_zlin import attention_zlin_path
    from membound_testing import chat_prompt, load_smollm2
    from paired_cache import sparsify_model
    from zstd_linear import compression_stats, load_compressed, reset_stats

    model, tokenizer = load_smollm2()
    config = model.config
    mlp_bytes = sum(
        p.numel() * p.element_size() for layer in model.model.layers for p in layer.mlp.parameters()
    )
    mlps = sparsify_model(model, "oracle", FRACTION)
    report = load_compressed(attention_zlin_path(), model, "per_pass_prefetch")
    reset_stats(model)
    cache = BMRTCache(
        model, BMRTConfig(budget=BUDGET, protection_divisor=4, block_size=BLOCK, selector="snapkv")
    )
    prompt = chat_prompt(tokenizer, QUESTION)
    gen = greedy_generate(model, tokenizer, prompt, past_key_values=cache, prefill_chunk_size=BLOCK)
    stats = compression_stats(model)
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    seen = cache.get_seq_length()
    resident = (
        sum(m.cache.active_bytes for m in mlps)
        + report.compressed_bytes
        + stats.peak_decoded_bytes
        + cache.peak_kv_bytes()
    )
    return Row(
        name=(
            f"combined: SparseMLP {round(FRACTION * 100)}% + zstd-linear attention "
            f"(ratio {report.ratio:.2f}) + bmrt-kv B={BUDGET} ({seen} tokens)"
        ),
        **gen.row_fields(),
        component="MLP rows read + attention Linear + KV",
        resident_bytes=resident,
        unbounded_bytes=mlp_bytes + report.original_bytes + seen * per_token,
    )


ROWS = {"combined": combined_row}


def _attention_zlin():
    from membound_integration.smollm2_zlin import attention_zlin_path

    return attention_zlin_path()


PREPARE = [_attention_zlin]
