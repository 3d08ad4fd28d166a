"""moe-expert-cache: a random Qwen3-MoE (mlx-lm) with half of its experts resident.

The checkpoint is written once by the preparation step (``python -m
membound_integration.prepare``) under ``$MEMBOUND_CACHE``; the row only reads it.
"""

from pathlib import Path

from membound_integration.row import Row

PROMPT_IDS = [3, 17, 42, 99, 7, 250, 31, 64]


def moe_checkpoint() -> Path:
    """The random MoE checkpoint (seeded, so the same on every machine), written once."""
    import shutil
    import tempfile

    import moe_expert_cache
    from membound_testing.models import cache_dir
    from moe_expert_cache import random_moe_config, write_random_moe

    path = cache_dir() / f"random-qwen3-moe-4bit-{moe_expert_cache.__version__}"
    if (path / "config.json").is_file():
        return path
    config = random_moe_config(
        "qwen3_moe", hidden_size=256, num_layers=4, num_experts=16, top_k=2, expert_size=256
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        write_random_moe(tmp, config, bits=4, shards=2)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def moe_expert_cache_row() -> Row:
    from mlx_lm.utils import load_model

    from moe_expert_cache import CacheConfig, generate, load_cached_model

    path = moe_checkpoint()
    cached = load_cached_model(path, CacheConfig(capacity=0.5, mode="exact"))
    result = generate(cached.model, PROMPT_IDS, 24, cached.manager)
    manager = cached.manager
    total = manager.total_metrics()
    cached.store.close()
    stock = generate(load_model(path)[0], PROMPT_IDS, 24).tokens
    return Row(
        name="random Qwen3-MoE 4-bit (mlx-lm), 50% of experts resident, exact mode",
        output=(
            f"tokens {' '.join(map(str, result.tokens))}; hit rate {total.hit_rate:.3f} "
            f"({total.hits}/{total.requests}), {total.swaps} swaps; "
            f"same tokens as the fully resident model: {stock == result.tokens}"
        ),
        tokens_per_s=result.tokens_per_s,
        correct=stock == result.tokens,
        component="MoE expert weights",
        resident_bytes=manager.resident_expert_bytes(),
        unbounded_bytes=manager.all_expert_bytes(),
    )


ROWS = {"moe_expert_cache": moe_expert_cache_row}
PREPARE = [moe_checkpoint]
