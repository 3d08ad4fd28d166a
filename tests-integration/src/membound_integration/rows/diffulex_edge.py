"""diffulex-edge: SmolLM2-135M-Instruct answering from its ExecuTorch .pte (XNNPACK, fp32,
the static_kv variant with block size 1: the KV cache is the program's own state, the prompt
enters in chunks of up to 32 tokens), with a static pre-allocated KV cache and no PyTorch
model in the process.

resident = the .pte's static KV cache (allocated once for max_seq tokens, whatever the
generation); unbounded = what a dynamic cache holds after the same generation
(layers x 2 x KV heads x head_dim x 4 bytes per committed token). The .pte is exported
once per diffulex-edge export code by the preparation step
(``python -m membound_integration.prepare``); the toy sort8 model lives in the package's
benchmarks.
"""

from pathlib import Path

from membound_integration.row import QUESTION, Row, storage_read_bytes

MAX_SEQ = 256
PREFILL = 32
MAX_NEW_TOKENS = 24


def smollm2_pte() -> Path:
    """SmolLM2 exported to a static_kv .pte under the cache, once per diffulex-edge export
    code (``export_code_digest``; the package's test suite uses the same file)."""
    from diffulex_edge import export_pte, load_checkpoint
    from diffulex_edge.export import export_code_digest
    from membound_testing.models import cache_dir, smollm2_float_dir

    name = (
        f"diffulex-edge-export-{export_code_digest()[:12]}-smollm2-f32-{MAX_SEQ}-1-{PREFILL}"
        "-static_kv.pte"
    )
    path = cache_dir() / name
    if not (path.is_file() and path.with_name(path.name + ".json").is_file()):
        path.parent.mkdir(parents=True, exist_ok=True)
        model = load_checkpoint(smollm2_float_dir())
        export_pte(model, path, MAX_SEQ, 1, "static_kv", prefill_size=PREFILL, progress=True)
    return path


def diffulex_edge_row() -> Row:
    import time

    from transformers import PreTrainedTokenizerFast

    from diffulex_edge import GenerationConfig, PteEngine
    from membound_testing.models import chat_prompt, smollm2_float_dir

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(smollm2_float_dir()))
    prompt = tokenizer(chat_prompt(tokenizer, QUESTION))["input_ids"]
    pte = smollm2_pte()
    engine = PteEngine(pte)
    engine.generate(prompt, GenerationConfig(max_new_tokens=2))  # warm-up, untimed
    read = storage_read_bytes()
    start = time.perf_counter()
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS))
    seconds = time.perf_counter() - start
    read = storage_read_bytes() - read
    text = tokenizer.decode(result.tokens, skip_special_tokens=True).strip()
    layout = engine.layout
    per_token = layout.nbytes // layout.max_seq
    committed = len(prompt) + max(len(result.tokens) - 1, 0)
    return Row(
        name="diffulex-edge SmolLM2-135M .pte (XNNPACK fp32, static_kv; resident = static KV; "
        "unbounded = dynamic KV after the same generation)",
        output=text,
        tokens_per_s=len(result.tokens) / seconds,
        correct="Paris" in text,
        component="KV cache",
        resident_bytes=layout.nbytes,
        unbounded_bytes=per_token * committed,
        new_tokens=len(result.tokens),
        decode_read_bytes=read,
    )


ROWS = {"diffulex_edge": diffulex_edge_row}
PREPARE = [smollm2_pte]
