"""Causal prefill in chunks: the same cache and logits as one token per forward, in
ceil(n / chunk) forwards (eager and through a real .pte)."""

import pytest
import torch
from random_sdar import random_model

from diffulex_edge.backends import EagerBlockKV, EagerDynamic, EagerStaticKV, StaticBackend
from diffulex_edge.config import tiny_config
from diffulex_edge.export import export_pte
from diffulex_edge.generate import GenerationConfig, generate_autoregressive
from diffulex_edge.kv_cache import StaticCacheLayout
from diffulex_edge.masks import causal_chunk_mask, chunk_positions
from diffulex_edge.runtime import PteEngine, method_step

MAX, CHUNK = 64, 16


@pytest.fixture(scope="module")
def ar_model():
    """A tiny model without a mask token: it decodes autoregressively."""
    return random_model(tiny_config(mask_token_id=None), seed=3)


def _counted(step, counter, key):
    def wrapped(*inputs):
        counter[key] += 1
        return step(*inputs)

    return wrapped


def _ids(n, seed=0):
    return torch.randint(0, 60, (1, n), generator=torch.Generator().manual_seed(seed))


def test_causal_chunk_mask_opens_the_cache_and_the_causal_triangle():
    layout = StaticCacheLayout(1, 1, 1, 8, 2, 4)
    mask = causal_chunk_mask(layout, cache_len=3, valid_len=2)[0, 0]  # (4, 12)
    open_ = mask == 0
    assert open_[:, :3].all() and not open_[:, 3:8].any()
    assert open_[:, 8:].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, False, False],  # padding rows see what the last real row sees
        [True, True, False, False],
    ]
    assert chunk_positions(layout, 3, 2).tolist() == [[3, 4, 4, 4]]


@pytest.mark.parametrize("n", [1, 15, 16, 37])
def test_chunked_prefill_equals_token_by_token_eager(ar_model, n):
    layout = StaticCacheLayout.for_model(ar_model.config, MAX, 1)
    chunked = EagerBlockKV(ar_model, layout, prefill_size=CHUNK)
    single = EagerBlockKV(ar_model, layout)
    ids = _ids(n)
    a, b = chunked.prefill_causal(ids), single.prefill_causal(ids)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked.kv_cache, single.kv_cache, rtol=0, atol=1e-5)
    assert chunked.cache_len == single.cache_len == n
    dynamic = EagerDynamic(ar_model, 1)
    torch.testing.assert_close(dynamic.prefill_causal(ids), a, rtol=0, atol=1e-5)
    every = []
    for backend in (chunked, single, dynamic):
        backend.reset()
        every.append(backend.prefill_causal(ids, all_logits=True))
    assert every[0].shape == (1, n, ar_model.config.vocab_size)
    torch.testing.assert_close(every[0], every[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(every[0], every[2], rtol=0, atol=1e-5)


def test_a_200_token_prompt_costs_ceil_200_over_chunk_forwards(ar_model):
    config = tiny_config(mask_token_id=None)
    layout = StaticCacheLayout.for_model(config, 256, 1)
    calls = {"forward": 0, "prefill": 0}
    step = ar_model.forward_block_kv
    backend = StaticBackend(
        layout,
        "block_kv",
        _counted(step, calls, "forward"),
        _counted(step, calls, "prefill"),
        32,
    )
    with torch.no_grad():
        backend.prefill_causal(_ids(200))
    assert calls == {"forward": 0, "prefill": 7}


@pytest.fixture(scope="module")
def ar_pte(ar_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("ar") / "ar.pte"
    export_pte(ar_model, path, MAX, 1, "block_kv", prefill_size=CHUNK)
    return path


def test_pte_prefill_method_equals_token_by_token_and_eager(ar_model, ar_pte):
    engine = PteEngine(ar_pte, expected_config=ar_model.config)
    assert engine.meta["prefill_size"] == CHUNK
    ids = _ids(37, seed=4)
    single = StaticBackend(engine.layout, "block_kv", method_step(engine.method))
    a, b = engine.backend.prefill_causal(ids), single.prefill_causal(ids)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    torch.testing.assert_close(engine.backend.kv_cache, single.kv_cache, rtol=0, atol=1e-4)
    eager = EagerDynamic(ar_model, 1)
    torch.testing.assert_close(a, eager.prefill_causal(ids), rtol=0, atol=1e-4)


def test_pte_autoregressive_tokens_equal_eager(ar_model, ar_pte):
    engine = PteEngine(ar_pte)
    config = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    prompt = _ids(21, seed=5)[0].tolist()
    want = generate_autoregressive(EagerDynamic(ar_model, 1), prompt, config, None)
    got = engine.generate(prompt, config)
    assert got.tokens == want.tokens and len(got.tokens) == 20
    assert got.denoise_forwards == 19


def test_prefill_size_needs_block_kv_and_to_divide_max_seq(ar_model, tmp_path):
    from diffulex_edge import DiffulexEdgeError

    with pytest.raises(DiffulexEdgeError, match="prefill_size needs variant 'block_kv' or"):
        export_pte(ar_model, tmp_path / "x.pte", MAX, 1, "cache_io", prefill_size=CHUNK)
    with pytest.raises(DiffulexEdgeError, match=r"prefill_size 24.*not a multiple"):
        export_pte(ar_model, tmp_path / "x.pte", MAX, 1, "block_kv", prefill_size=24)
    with pytest.raises(
        DiffulexEdgeError, match=r"'static_kv' needs block_size 1.*got block_size 4"
    ):
        export_pte(ar_model, tmp_path / "x.pte", MAX, 4, "static_kv", prefill_size=CHUNK)
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def ar_static_pte(ar_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("ar") / "ar_static.pte"
    export_pte(ar_model, path, MAX, 1, "static_kv", prefill_size=CHUNK)
    return path


@pytest.mark.parametrize("n", [1, CHUNK - 1, CHUNK, 37])
def test_static_kv_chunks_of_any_length_equal_eager(ar_model, ar_static_pte, n):
    """One method, a dynamic chunk length: the prompt in ceil(n / 16) forwards, unpadded."""
    engine = PteEngine(ar_static_pte, expected_config=ar_model.config)
    assert engine.variant == "static_kv" and engine.backend.kv_cache is None
    calls = {"prefill": 0}
    engine.backend.prefill_step = _counted(engine.backend.prefill_step, calls, "prefill")
    ids = _ids(n, seed=6)
    got = engine.backend.prefill_causal(ids, all_logits=True)
    assert calls["prefill"] == -(-n // CHUNK) and engine.backend.cache_len == n
    want = EagerDynamic(ar_model, 1).prefill_causal(ids, all_logits=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    eager = EagerStaticKV(ar_model, engine.layout, CHUNK).prefill_causal(ids, all_logits=True)
    torch.testing.assert_close(eager, want, rtol=0, atol=1e-4)


def test_static_kv_autoregressive_tokens_equal_eager_after_a_reset(ar_model, ar_static_pte):
    """The cache is the program's own state: a second generation on the same engine, after
    a longer first one left stale slots, still equals eager."""
    engine = PteEngine(ar_static_pte)
    config = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    engine.generate(_ids(40, seed=7)[0].tolist(), config)
    prompt = _ids(21, seed=5)[0].tolist()
    want = generate_autoregressive(EagerDynamic(ar_model, 1), prompt, config, None)
    got = engine.generate(prompt, config)
    assert got.tokens == want.tokens and len(got.tokens) == 20


def test_static_kv_refuses_a_prompt_past_max_seq_before_running_it(ar_model, ar_static_pte):
    engine = PteEngine(ar_static_pte)
    calls = {"prefill": 0}
    engine.backend.prefill_step = _counted(engine.backend.prefill_step, calls, "prefill")
    with pytest.raises(ValueError, match=f"a prompt of {MAX + 1} tokens after cache_len 0 does"):
        engine.backend.prefill_causal(_ids(MAX + 1))
    assert calls["prefill"] == 0 and engine.backend.cache_len == 0
    engine.backend.prefill_causal(_ids(MAX))
    with pytest.raises(ValueError, match=f"after cache_len {MAX} does not fit max_seq {MAX}"):
        engine.backend.commit(torch.tensor([[1]]))


def test_autoregressive_decoding_refuses_a_diffusion_block(ar_model):
    layout = StaticCacheLayout.for_model(ar_model.config, MAX, 4)
    with pytest.raises(ValueError, match="block_size 1"):
        generate_autoregressive(EagerBlockKV(ar_model, layout), [1, 2], GenerationConfig(), None)
