"""bmrt-kv row: SmolLM2-135M reads a ~6k-token pass-key prompt through a B=512 bounded cache."""

from membound_integration.row import Row

PASS_KEY = 48213


def bmrt_kv_row() -> Row:
    import time

    from bmrt_kv import BMRTConfig
    from bmrt_kv.stream import BoundedStream
    from membound_testing import load_smollm2, passkey_prompt

    model, tokenizer = load_smollm2()
    prompt = passkey_prompt(tokenizer, 6000, key=PASS_KEY, depth=0.5)
    context, question = prompt.rsplit("\n", 1)
    config = BMRTConfig(budget=512, block_size=512, selector="snapkv", scoring="query_aware")
    stream = BoundedStream(model, tokenizer, config, question=question)
    start = time.perf_counter()
    stream.feed(context + "\n")
    answer = stream.ask(question, max_new_tokens=8)
    seconds = time.perf_counter() - start

    # A full DynamicCache over the same stream holds every token in every layer (float32).
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 4
    return Row(
        name=f"bmrt-kv B=512 ({stream.cache.get_seq_length()}-token pass key)",
        output=f"{answer} (pass key {PASS_KEY})",
        tokens_per_s=stream.stats.decode_tokens / seconds,
        component="KV cache",
        resident_bytes=stream.stats.peak_kv_bytes,
        unbounded_bytes=stream.cache.get_seq_length() * per_token,
    )


ROWS = {"bmrt_kv": bmrt_kv_row}
