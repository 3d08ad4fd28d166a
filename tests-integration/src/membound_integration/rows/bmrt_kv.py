"""bmrt-kv rows: SmolLM2-135M reads a ~6k-token pass-key prompt through a B=512 bounded
cache, and (next row, its own process) the plain model reads it with a full DynamicCache."""

from membound_integration.row import Row

PASS_KEY = 48213
PROMPT_TOKENS = 6000
BLOCK = 512


def _prompt(tokenizer) -> str:
    from membound_testing import passkey_prompt

    return passkey_prompt(tokenizer, PROMPT_TOKENS, key=PASS_KEY, depth=0.5)


def _full_kv_bytes(config, tokens: int) -> int:
    """Bytes a DynamicCache holds for ``tokens`` tokens in every layer (float32 K and V)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return tokens * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4


def bmrt_kv_row() -> Row:
    import time

    from bmrt_kv import BMRTConfig
    from bmrt_kv.stream import BoundedStream
    from membound_testing import load_smollm2

    model, tokenizer = load_smollm2()
    context, question = _prompt(tokenizer).rsplit("\n", 1)
    config = BMRTConfig(budget=512, block_size=BLOCK, selector="snapkv", scoring="query_aware")
    stream = BoundedStream(model, tokenizer, config, question=question, progress=True)
    start = time.perf_counter()
    stream.feed(context + "\n")
    answer = stream.ask(question, max_new_tokens=8)
    seconds = time.perf_counter() - start
    seen = stream.cache.get_seq_length()
    return Row(
        name=f"bmrt-kv B=512 ({seen}-token pass key; tokens/s: prompt + answer)",
        output=f"{answer} (pass key {PASS_KEY})",
        tokens_per_s=(stream.stats.prefill_tokens + stream.stats.decode_tokens) / seconds,
        correct=str(PASS_KEY) in answer,
        component="KV cache",
        resident_bytes=stream.stats.peak_kv_bytes,
        unbounded_bytes=_full_kv_bytes(model.config, seen),
    )


def plain_passkey_row() -> Row:
    """The same prompt through the plain model and a full DynamicCache (the answer to
    compare with, and the peak RSS a full cache costs)."""
    import time

    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from membound_testing import load_smollm2

    model, tokenizer = load_smollm2()
    ids = tokenizer(_prompt(tokenizer), return_tensors="pt").input_ids  # (1, T)
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    with torch.inference_mode():
        # The prompt but its last token in BLOCK-token chunks (a bar over them: this is
        # the long step); generate then reads the last token and decodes.
        for chunk in tqdm(ids[:, :-1].split(BLOCK, dim=-1), desc="prefill", unit="block"):
            model(input_ids=chunk, past_key_values=cache)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    seconds = time.perf_counter() - start
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    seen = cache.get_seq_length()
    return Row(
        name=f"plain, full KV cache (same {ids.shape[1]}-token pass key; tokens/s: prompt + answer)",
        output=f"{answer} (pass key {PASS_KEY})",
        tokens_per_s=out.shape[1] / seconds,
        correct=str(PASS_KEY) in answer,
        component="KV cache",
        resident_bytes=_full_kv_bytes(model.config, seen),
        unbounded_bytes=_full_kv_bytes(model.config, seen),
    )


ROWS = {"bmrt_kv": bmrt_kv_row, "plain_passkey": plain_passkey_row}
