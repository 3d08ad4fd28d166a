"""diffulex-edge: the bundled tiny SDAR model (trained on 8-digit sorting) decoding by block
diffusion through its ExecuTorch .pte (XNNPACK), with a static pre-allocated KV cache.

resident = the .pte's static KV cache (allocated once, whatever the generation);
unbounded = the dynamic cache an eager run holds after the same generation. The .pte is
exported once by the preparation step (``python -m membound_integration.prepare``).
"""

from pathlib import Path

from membound_integration.row import Row

PROMPT = "31415926"
MAX_SEQ = 32
BLOCK = 4


def sort8_pte() -> Path:
    """The trained sort8 checkpoint exported to a block_kv .pte under the cache, once."""
    import diffulex_edge
    from diffulex_edge import export_pte, load_checkpoint, trained_checkpoint
    from membound_testing.models import cache_dir

    path = cache_dir() / f"diffulex-edge-{diffulex_edge.__version__}-sort8-{MAX_SEQ}-{BLOCK}.pte"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        export_pte(load_checkpoint(trained_checkpoint()), path, MAX_SEQ, BLOCK, "block_kv")
    return path


def diffulex_edge_row() -> Row:
    import time

    from diffulex_edge import (
        EagerDynamic,
        GenerationConfig,
        PteEngine,
        generate,
        load_checkpoint,
        trained_checkpoint,
    )
    from diffulex_edge.kv_cache import StaticCacheLayout
    from diffulex_edge.task import decode, encode

    model = load_checkpoint(trained_checkpoint())
    c = model.config
    config = GenerationConfig(max_new_tokens=12, remasking="low_confidence_dynamic")
    prompt = encode(PROMPT)
    pte = sort8_pte()
    engine = PteEngine(pte, expected_config=c)
    engine.generate(prompt, config)  # warm-up
    start = time.perf_counter()
    result = engine.generate(prompt, config)
    seconds = time.perf_counter() - start
    eager = EagerDynamic(model, BLOCK)
    generate(eager, prompt, config, c.mask_token_id, c.eos_token_id)
    return Row(
        name="diffulex-edge tiny SDAR sort8 .pte (resident = static KV; unbounded = dynamic KV "
        "after the same generation)",
        output=f"sort {PROMPT} -> {decode(result.tokens)} ({result.tokens_per_forward:.2f} "
        f"tokens/forward, .pte {pte.stat().st_size / 2**20:.2f} MiB)",
        tokens_per_s=result.decoded_tokens / seconds,
        correct=decode(result.tokens) == "".join(sorted(PROMPT)),
        component="KV cache",
        resident_bytes=StaticCacheLayout.for_model(c, max_seq=MAX_SEQ, block_size=BLOCK).nbytes,
        unbounded_bytes=eager.cache.nbytes,
    )


ROWS = {"diffulex_edge": diffulex_edge_row}
PREPARE = [sort8_pte]
