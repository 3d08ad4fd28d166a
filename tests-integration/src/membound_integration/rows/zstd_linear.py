"""zstd-linear: SmolLM2-135M with every Linear and the tied embedding zstd-compressed,
under the ``budget`` policy sized by ``memory_limit="auto"`` (the cgroup's hard limit):
what the limit leaves after the runtime and the mapped compressed bytes is pinned
decoded, the rest is decoded per pass with prefetch, and the tied lm_head is streamed a
group of chunks at a time unless it is pinned.

The Linear layers and the embedding table (which the tied lm_head shares) are loaded from a
cached, memory-mapped .zlin file (built on first use), so the row's process never holds the
plain weights: its compressed bytes are file-backed pages.
"""

import sys

from membound_integration.row import QUESTION, Row, greedy_generate


def zstd_linear_model() -> Row:
    from membound_integration.smollm2_zlin import load_compressed_smollm2
    from membound_testing import chat_prompt
    from zstd_linear import compression_stats, reset_stats
    from zstd_linear.model import runtime_of

    model, tokenizer, report = load_compressed_smollm2("budget", memory_limit="auto")
    policy = runtime_of(model).policy
    reset_stats(model)
    gen = greedy_generate(model, tokenizer, chat_prompt(tokenizer, QUESTION))
    stats = compression_stats(model)
    # The embedding table is stored once and serves the tied lm_head too: it counts once.
    # The name stays the same under every limit, so that the runner's profiles share a
    # row; what the limit pinned goes to stderr.
    print(
        f"zstd-linear budget: limit {policy.memory_limit >> 20} MiB, pinned "
        f"{len(policy.pinned)} layers ({policy.pinned_bytes >> 20} MiB decoded), "
        f"{stats.decompressions_per_pass:.0f} decodes/pass",
        file=sys.stderr,
    )
    return Row(
        name=(
            f"zstd-linear budget(memory_limit=auto), {len(report.layers) - 1} Linear + tied "
            f"embedding from .zlin (ratio {report.ratio:.2f})"
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
