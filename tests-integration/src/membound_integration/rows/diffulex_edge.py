"""diffulex-edge: the bundled tiny SDAR model (trained on 8-digit sorting) decoding by block
diffusion through its ExecuTorch .pte (XNNPACK), with a static pre-allocated KV cache.

resident = the .pte's static KV cache (allocated once, whatever the generation);
unbounded = the dynamic cache an eager run holds after the same generation.
"""

from membound_integration.row import Row

PROMPT = "31415926"
MAX_SEQ = 32


def diffulex_edge_row() -> Row:
    import tempfile
    import time
    from pathlib import Path

    from diffulex_edge import (
        EagerDynamic,
        GenerationConfig,
        PteEngine,
        export_pte,
        generate,
        load_checkpoint,
        trained_checkpoint,
    )
    from diffulex_edge.task import decode, encode

    model = load_checkpoint(trained_checkpoint())
    c = model.config
    config = GenerationConfig(max_new_tokens=12, remasking="low_confidence_dynamic")
    prompt = encode(PROMPT)
    with tempfile.TemporaryDirectory() as tmp:
        exported = export_pte(model, Path(tmp) / "sort8.pte", MAX_SEQ, 4, "block_kv")
        engine = PteEngine(exported.path, expected_config=c)
        engine.generate(prompt, config)  # warm-up
        start = time.perf_counter()
        result = engine.generate(prompt, config)
        seconds = time.perf_counter() - start
    eager = EagerDynamic(model, 4)
    generate(eager, prompt, config, c.mask_token_id, c.eos_token_id)
    return Row(
        name="diffulex-edge tiny SDAR sort8 .pte (resident = static KV; unbounded = dynamic KV "
        "after the same generation)",
        output=f"sort {PROMPT} -> {decode(result.tokens)} ({result.tokens_per_forward:.2f} "
        f"tokens/forward, .pte {exported.pte_bytes / 2**20:.2f} MiB)",
        tokens_per_s=result.decoded_tokens / seconds,
        component="KV cache",
        resident_bytes=exported.layout.nbytes,
        unbounded_bytes=eager.cache.nbytes,
    )


ROWS = {"diffulex_edge": diffulex_edge_row}
