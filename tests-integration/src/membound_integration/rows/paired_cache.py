"""paired-cache row: every MLP of SmolLM2-135M as a SparseMLP at 50% active rows.

Each token's mask is the oracle top-k (the k neurons with the largest |silu(gate x) * up x|),
and the paired-replacement cache packs those rows; the bounded component is the MLP weight
that the matmuls read per token.
"""

from membound_integration.row import QUESTION, Row, greedy_generate

FRACTION = 0.5


def paired_cache_row() -> Row:
    from membound_testing import chat_prompt, load_smollm2
    from paired_cache.sparse_mlp import sparsify_model

    model, tokenizer = load_smollm2()
    full_mlp_bytes = sum(
        p.numel() * p.element_size() for layer in model.model.layers for p in layer.mlp.parameters()
    )
    mlps = sparsify_model(model, "oracle", FRACTION)
    gen = greedy_generate(model, tokenizer, chat_prompt(tokenizer, QUESTION))
    return Row(
        name=f"SparseMLP {round(FRACTION * 100)}% rows, oracle top-k (paired-cache)",
        **gen.row_fields(),
        component="MLP weights read per token",
        resident_bytes=sum(m.cache.active_bytes for m in mlps),
        unbounded_bytes=full_mlp_bytes,
    )


ROWS = {"paired_cache": paired_cache_row}
