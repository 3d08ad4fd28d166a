"""The cache under stock mlx-lm generation (#19): ``mlx_lm.generate`` and
``stream_generate`` call the model and nothing else, so the patched model's own forward
runs the between-token update and checks the token ids."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from conftest import PROMPT
from mlx_lm.utils import load_model, load_tokenizer

from moe_expert_cache import ExpertCacheConfig, ExpertCacheError, generate, load_cached_model

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def real_prompt(real_moe):
    tokenizer = load_tokenizer(real_moe)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    return tokenizer, ids


@pytest.fixture(scope="module")
def stock_tokens(real_moe, real_prompt):
    tokenizer, ids = real_prompt
    model, _ = load_model(real_moe)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=NEW_TOKENS)]


def forwarded_tokens(prompt: list[int]) -> int:
    """Tokens the model sees under stock generation: the prompt, then one forward per new
    token (the last forward's token is computed ahead and never emitted)."""
    return len(prompt) + NEW_TOKENS


def test_exact_mode_under_stream_generate_counts_every_forward_and_equals_stock(
    real_moe, real_prompt, stock_tokens
):
    tokenizer, ids = real_prompt
    cached = load_cached_model(real_moe, ExpertCacheConfig(capacity_share=0.5, mode="exact"))
    layer0 = cached.manager.layers[0]
    tokens, seen = [], []
    for r in mlx_lm.stream_generate(cached.model, tokenizer, ids, max_tokens=NEW_TOKENS):
        tokens.append(r.token)
        seen.append(layer0.metrics.requests)  # read raw: no flush of the pending forward
    assert tokens == stock_tokens
    # When token n is emitted, the forward of token n + 1 has started, and its start
    # folded in every forward before it: the prompt (L - 1 tokens, then its last) and n.
    k = cached.manager.top_k
    assert seen == [(len(ids) + n) * k for n in range(NEW_TOKENS)]
    manager = cached.manager
    for m in manager.metrics():
        assert m.requests == forwarded_tokens(ids) * manager.top_k
        assert m.hits + m.misses == m.requests and m.skipped == 0
    total = manager.total_metrics()
    assert total.misses > 0 and total.swaps > 0  # half the experts: it had to load some
    assert total.bytes_read == total.swaps * manager.layers[0].expert_nbytes


def test_exact_mode_under_generate_gives_stock_text(real_moe, real_prompt, stock_tokens):
    tokenizer, ids = real_prompt
    cached = load_cached_model(real_moe, ExpertCacheConfig(capacity_share=0.25, mode="exact"))
    text = mlx_lm.generate(cached.model, tokenizer, ids, max_tokens=NEW_TOKENS)
    assert text == tokenizer.decode(stock_tokens)
    assert cached.manager.total_metrics().swaps > 0


def test_skip_mode_swaps_under_generate(real_moe, real_prompt):
    tokenizer, ids = real_prompt
    cached = load_cached_model(real_moe, ExpertCacheConfig(capacity_share=0.5, mode="skip"))
    before = [list(layer.slots.slot_to_expert) for layer in cached.manager.layers]
    swaps_while_generating = []

    def progress(processed: int, total: int) -> None:
        swaps_while_generating.append(sum(layer.metrics.swaps for layer in cached.manager.layers))

    mlx_lm.generate(
        cached.model, tokenizer, ids, max_tokens=NEW_TOKENS, prompt_progress_callback=progress
    )
    # Between the prompt's two forwards (L - 1 tokens, then the last) the cache swapped.
    assert swaps_while_generating[-1] > 0, swaps_while_generating
    total = cached.manager.total_metrics()
    assert total.requests == forwarded_tokens(ids) * 4 * len(cached.manager.layers)
    assert total.skipped == total.misses > 0
    assert total.swaps > 0
    after = [list(layer.slots.slot_to_expert) for layer in cached.manager.layers]
    assert after != before


def test_own_loop_and_stock_loop_do_the_same_updates(model_dir):
    """The package's loop updates after each token, the forward hook before the next one:
    the same updates, so skip mode gives the same tokens and cache either way."""
    path = model_dir("qwen3_moe", 4)
    config = ExpertCacheConfig(capacity=3, mode="skip")
    own = load_cached_model(path, config)
    want = generate(own.model, PROMPT, 10, own.manager).tokens
    hooked = load_cached_model(path, config)
    got = generate(hooked.model, PROMPT, 10).tokens  # no manager: only the hook updates
    assert got == want
    assert own.manager.total_metrics().swaps > 0
    assert hooked.manager.total_metrics() == own.manager.total_metrics()
    assert hooked.manager.state() == own.manager.state()


def test_the_cached_model_refuses_ids_outside_the_vocabulary(model_dir):
    cached = load_cached_model(model_dir("mixtral"), ExpertCacheConfig(capacity_share=0.5))
    with pytest.raises(ExpertCacheError, match=r"vocab_size=256\), got \[1000000\]"):
        cached.model(mx.array([[1, 1000000]]))
    with pytest.raises(ExpertCacheError, match=r"got \[-1\]"):
        cached.model(mx.array([[-1]]))
    with pytest.raises(ExpertCacheError, match="integer array"):
        cached.model(mx.array([[1.5]]))
    assert cached.manager.total_metrics().requests == 0  # nothing ran
    logits = cached.model(mx.array([[255]]))
    assert np.isfinite(np.array(logits)).all()


def test_an_out_of_vocabulary_id_is_an_error_not_a_segfault(model_dir):
    """Stock MLX reads past the embedding table on such an id (a segfault, status -11), so
    this runs in a child process."""
    code = (
        "import sys, mlx.core as mx\n"
        "from moe_expert_cache import ExpertCacheError, load_cached_model\n"
        f"cached = load_cached_model({str(model_dir('mixtral'))!r})\n"
        "try:\n"
        "    cached.model(mx.array([[1000000]]))\n"
        "except ExpertCacheError as e:\n"
        "    print('refused:', e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "refused: token ids must be in [0, vocab_size=256)" in result.stdout
