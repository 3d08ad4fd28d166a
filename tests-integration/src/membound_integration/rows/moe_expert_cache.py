"""moe-expert-cache: SmolLM2-135M MoEfied into a shared expert of 1,152 neurons and 128
routed experts of 3 per layer (a real-weights Qwen2-MoE built by membound_testing.moefy,
top-48: ``demo_config``), with half of its routed experts resident, exact mode.

The checkpoint is built once by the preparation step (``python -m
membound_integration.prepare``) under ``$MEMBOUND_CACHE``; the row only finds it.
"""

from pathlib import Path

from membound_integration.row import ANSWER, QUESTION, Row, storage_read_bytes

NEW_TOKENS = 24


def moe_checkpoint() -> Path:
    """The MoE checkpoint, keyed by everything the build reads, sealed by the package."""
    from membound_testing.models import cache_dir, smollm2_float_dir
    from membound_testing.moefy import demo_config, moefy_cached
    from moe_expert_cache import seal_model

    # The shared expert carries the neurons nearly every token uses: with 256 of them the
    # MoE answered "a font" (moe-expert-cache README, Limits).
    return moefy_cached(smollm2_float_dir(), cache_dir(), demo_config(), seal=seal_model)


def moe_expert_cache_row() -> Row:
    from mlx_lm.utils import load_model, load_tokenizer

    from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model

    path = moe_checkpoint()
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    cached = load_cached_model(path, ExpertCacheConfig(capacity_share=0.5, mode="exact"))
    read = storage_read_bytes()
    result = generate(cached.model, prompt, NEW_TOKENS, cached.manager)
    read = storage_read_bytes() - read
    manager = cached.manager
    total = manager.total_metrics()
    resident, unbounded = manager.resident_expert_bytes(), manager.all_expert_bytes()
    cached.store.close()
    del cached
    stock = generate(load_model(path)[0], prompt, NEW_TOKENS).tokens
    text = tokenizer.decode(result.tokens, skip_special_tokens=True).strip()
    same = stock == result.tokens
    return Row(
        name=(
            "SmolLM2-135M MoEfied (Qwen2-MoE, shared expert 1152 + 128 experts x 3, top-48), "
            "50% of experts resident, exact"
        ),
        output=(
            f"{text!r}; hit rate {total.hit_rate:.3f} ({total.hits}/{total.requests}), "
            f"{total.swaps} swaps; same tokens as stock mlx-lm: {same}; "
            f"{ANSWER!r} in answer: {ANSWER in text}"
        ),
        tokens_per_s=result.tokens_per_s,
        correct=same,
        component="MoE expert weights",
        resident_bytes=resident,
        unbounded_bytes=unbounded,
        new_tokens=len(result.tokens),
        decode_read_bytes=read,
    )


ROWS = {"moe_expert_cache": moe_expert_cache_row}
PREPARE = [moe_checkpoint]
