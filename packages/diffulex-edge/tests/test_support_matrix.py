"""The support matrix (#55): every dense family a user brings, imported from its
transformers model, exported to a .pte and decoded greedily, token for token the same as
diffulex-edge's eager model and transformers' own ``generate``; the rest refused by name.

Each family is a tiny random-weights model built offline from its config class
(``membound_testing.families``): 4 layers (2 for the exports), GQA 4:1, Gemma's sliding window of 8 mixed with
full layers. The prompt (12 tokens) and the 8 new tokens run past the window, and the
prompt enters the program in chunks of 8, so a windowed layer is tested across a chunk
boundary and on keys that left its window.
"""

from __future__ import annotations

import pytest
import torch

from diffulex_edge import DiffulexEdgeError, PteEngine, export_pte, load_checkpoint
from diffulex_edge.backends import EagerBlockKV, EagerCacheIO, EagerDynamic, EagerStaticKV
from diffulex_edge.generate import GenerationConfig, generate_autoregressive
from diffulex_edge.hf_import import from_hf_model
from diffulex_edge.kv_cache import StaticCacheLayout
from membound_testing.families import DENSE, NON_GATED, VOCAB, WINDOW, tiny_model
from membound_testing.support import record

PACKAGE = "diffulex-edge"
PROMISE = ".pte tokens = eager = transformers"
NEW_TOKENS = 8
PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(55)).tolist()
MAX_SEQ = 32
PREFILL = 8


def _family_model(family: str, layers: int | None = None):
    # No eos keeps transformers from stopping early, so both sides produce all NEW_TOKENS.
    if layers is None:
        return tiny_model(family, eos_token_id=None)
    # Two layers for the exports (ExecuTorch's lowering dominates a test's time, per
    # layer), one sliding and one full where the family mixes them.
    extra = {"layer_types": ["sliding_attention", "full_attention"]}
    return tiny_model(
        family,
        eos_token_id=None,
        num_hidden_layers=layers,
        **(extra if family == "gemma3_text" else {}),
    )


def _transformers_greedy(hf) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("family", DENSE)
def test_pte_greedy_tokens_equal_eager_and_transformers(family, tmp_path):
    hf = _family_model(family, layers=2)
    want = _transformers_greedy(hf)
    model = from_hf_model(hf)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    eager = generate_autoregressive(EagerDynamic(model, 1), PROMPT, config).tokens
    result = export_pte(
        model, tmp_path / f"{family}.pte", MAX_SEQ, 1, "static_kv", prefill_size=PREFILL
    )
    engine = PteEngine(result.path, expected_config=model.config)
    assert engine.variant == "static_kv" and engine.layout.block_size == 1
    pte = engine.generate(PROMPT, config).tokens
    assert len(want) == NEW_TOKENS
    assert eager == want, f"{family}: eager {eager} vs transformers {want}"
    assert pte == want, f"{family}: .pte {pte} vs transformers {want}"
    record(PACKAGE, family, PROMISE)


WINDOWED = [
    ("gemma2", {}),
    ("gemma3_text", {}),
    ("mistral", {"sliding_window": WINDOW}),
    ("phi3", {"sliding_window": WINDOW}),
    ("olmo2", {}),
    ("smollm3", {}),
]


@pytest.mark.parametrize("family, overrides", WINDOWED, ids=[f for f, _ in WINDOWED])
def test_every_static_graph_decodes_like_transformers_in_eager_mode(family, overrides):
    """The three graphs the exporter can write (cache_io, block_kv with prefill chunks,
    static_kv with prefill chunks), run eagerly, on the families whose attention differs
    most (windows, post norms, NoPE): Mistral's and Phi-3's optional window too."""
    hf = tiny_model(family, eos_token_id=None, **overrides)
    want = _transformers_greedy(hf)
    model = from_hf_model(hf)
    layout = StaticCacheLayout.for_model(model.config, max_seq=MAX_SEQ, block_size=1)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, stop_on_eos=False)
    backends = {
        "cache_io": EagerCacheIO(model, layout),
        "block_kv": EagerBlockKV(model, layout, PREFILL),
        "static_kv": EagerStaticKV(model, layout, PREFILL),
    }
    for name, backend in backends.items():
        got = generate_autoregressive(backend, PROMPT, config).tokens
        assert got == want, f"{family} {name}: {got} vs transformers {want}"


@pytest.mark.parametrize("family", DENSE)
def test_a_saved_transformers_directory_loads_without_transformers(family, tmp_path):
    """load_checkpoint reads save_pretrained's directory (config.json + safetensors) into
    the model from_hf_model builds; Phi-3's fused tensors are refused by name there."""
    hf = _family_model(family)
    hf.save_pretrained(tmp_path)
    if family == "phi3":
        with pytest.raises(DiffulexEdgeError, match=r"missing.*q_proj.*unexpected.*qkv_proj"):
            load_checkpoint(tmp_path)
        return
    ids = torch.tensor([PROMPT])
    mask = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()[None]
    positions = torch.arange(len(PROMPT))[None]
    with torch.no_grad():
        want = hf(ids).logits
        imported = from_hf_model(hf)(ids, positions, attention_mask=mask)
        loaded = load_checkpoint(tmp_path)(ids, positions, attention_mask=mask)
    torch.testing.assert_close(imported, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(loaded, imported)


def test_the_hybrid_families_mix_window_and_full_layers():
    """What the matrix above exercises for Gemma: both layer kinds, the window shorter than
    the sequence, Gemma 3's local RoPE base, Gemma 2's soft-capping."""
    g2 = from_hf_model(_family_model("gemma2")).config
    g3 = from_hf_model(_family_model("gemma3_text")).config
    for c in (g2, g3):
        assert {"sliding_attention", "full_attention"} == set(c.layer_types)
        assert c.sliding_window == WINDOW < len(PROMPT) + NEW_TOKENS
        assert c.hidden_act == "gelu_pytorch_tanh" and c.norm_layout == "sandwich"
    assert g2.attn_logit_softcapping == 50.0 and g2.final_logit_softcapping == 30.0
    assert g3.rope_local_theta == 10000.0 != g3.rope_theta and g3.qk_norm


@pytest.mark.parametrize("family", NON_GATED)
def test_non_gated_families_are_refused_by_name_before_anything_is_written(family, tmp_path):
    hf = tiny_model(family)
    with pytest.raises(DiffulexEdgeError, match=f"model_type '{family}' is not supported") as info:
        model = from_hf_model(hf)
        export_pte(model, tmp_path / f"{family}.pte", MAX_SEQ, 1, "static_kv")
    assert list(tmp_path.iterdir()) == []
    record(PACKAGE, family, PROMISE, refused=info.value)
