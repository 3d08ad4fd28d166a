"""zstd-linear: SmolLM2-135M with every Linear zstd-compressed, decoded per pass with prefetch.

The Linear layers are loaded from a cached .zlin file (built on first use), so the row's
process never holds the plain Linear weights: its peak RSS is the compressed model's.
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
    # The tied lm_head stays plain (it is the embedding's tensor), so it is counted on
    # neither side: the component is the compressed Linear layers' weights.
    return Row(
        name=(
            f"zstd-linear per_pass_prefetch, {len(report.layers)} Linear from .zlin "
            f"(ratio {report.ratio:.2f}, {stats.decompressions_per_pass:.0f} decodes/pass)"
        ),
        **gen.row_fields(),
        component="Linear weights",
        resident_bytes=stats.peak_decoded_bytes + report.compressed_bytes,
        unbounded_bytes=report.original_bytes,
    )


ROWS = {"zstd_linear": zstd_linear_model}


def _zlin():
    from membound_integration.smollm2_zlin import compressed_smollm2_path

    return compressed_smollm2_path(progress=True)


PREPARE = [_zlin]
