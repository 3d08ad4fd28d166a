"""zstd-linear: SmolLM2-135M with every Linear and the tied embedding zstd-compressed,
decoded per pass with prefetch.

The Linear layers and the embedding table (which the tied lm_head shares) are loaded from a
cached, memory-mapped .zlin file (built on first use), so the row's process never holds the
plain weights: its compressed bytes are file-backed pages.
"""

from membound_integration.row import QUESTION, Row, greedy_generate


def zstd_linear_model() -> Row:
    from membound_integration.smollm2_zlin import load_compressed_smollm2
    from membound_testing import chat_prompt
    from zstd_linear import compression_stats, reset_stats

    model, tokenizer, report = load_compressed_smollm2("per_pass_prefetch")
    reset_stats(model)
    gen = greedy_generate(model, tokenizer, chat_prompt(tokenizer, QUESTION))
    stats = compression_stats(model)
    # The embedding table is stored once and serves the tied lm_head too: it counts once.
    return Row(
        name=(
            f"zstd-linear per_pass_prefetch, {len(report.layers) - 1} Linear + tied embedding "
            f"from .zlin (ratio {report.ratio:.2f}, {stats.decompressions_per_pass:.0f} "
            "decodes/pass)"
        ),
        **gen.row_fields(),
        component="Linear + embedding weights",
        resident_bytes=stats.peak_decoded_bytes + report.compressed_bytes,
        unbounded_bytes=report.original_bytes,
    )


ROWS = {"zstd_linear": zstd_linear_model}


def _zlin():
    from membound_integration.smollm2_zlin import compressed_smollm2_path

    return compressed_smollm2_path(progress=True)


PREPARE = [_zlin]
