"""Hugging Face Llama / Qwen2 / Qwen3 checkpoints on the SDAR model, against transformers."""

import json

import pytest
import torch
import transformers

from diffulex_edge import DiffulexEdgeError, load_checkpoint
from diffulex_edge.backends import EagerDynamic
from diffulex_edge.config import SDARConfig
from diffulex_edge.generate import GenerationConfig, generate_autoregressive
from diffulex_edge.hf_import import from_hf_model, load_gguf
from membound_testing.models import load_smollm2, smollm2_float_dir, smollm2_gguf_path

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=5000.0,
)


def _tiny_hf(kind: str, tie: bool):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tie)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**TINY, tie_word_embeddings=tie)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=tie)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # norm gains and biases start at 1 and 0: perturb them too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape))
    return model.eval()


def _causal_logits(model, ids):
    n = ids.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        return model(ids, torch.arange(n)[None], attention_mask=mask)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tie", [True, False])
def test_tiny_hf_models_give_transformers_logits(kind, tie, tmp_path):
    hf = _tiny_hf(kind, tie)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids).logits
    model = from_hf_model(hf)
    assert (model.config.qk_norm, model.config.qkv_bias) == {
        "llama": (False, False),
        "qwen2": (False, True),
        "qwen3": (True, False),
    }[kind]
    assert model.config.rope_theta == 5000.0
    torch.testing.assert_close(_causal_logits(model, ids), want, rtol=0, atol=1e-5)
    hf.save_pretrained(tmp_path)  # safetensors route: no transformers needed to read it
    loaded = load_checkpoint(tmp_path)
    torch.testing.assert_close(_causal_logits(loaded, ids), want, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def smollm2():
    hf, tokenizer = load_smollm2()
    return hf, tokenizer, load_checkpoint(smollm2_float_dir())


def test_smollm2_eager_logits_equal_transformers(smollm2):
    hf, tokenizer, model = smollm2
    assert model.config.num_hidden_layers == 30 and not model.config.qk_norm
    assert model.config.tie_word_embeddings and model.config.rope_theta == 100000.0
    ids = torch.tensor([tokenizer("The capital of France is Paris, and the capital")["input_ids"]])
    with torch.no_grad():
        want = hf(ids).logits
    got = _causal_logits(model, ids)
    assert (got - want).abs().max().item() <= 1e-4


def test_smollm2_greedy_decoding_equals_transformers(smollm2):
    hf, tokenizer, model = smollm2
    ids = tokenizer("The three primary colors are")["input_ids"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    config = GenerationConfig(max_new_tokens=16, stop_on_eos=False)
    got = generate_autoregressive(EagerDynamic(model, 1), ids, config, 2)
    assert got.tokens == want[0, len(ids) :].tolist()
    assert got.denoise_forwards == 15  # the prompt in one forward, then one per token


def test_gguf_dequantised_through_transformers_equals_the_float_copy(smollm2):
    _, _, model = smollm2
    from_gguf = load_gguf(smollm2_gguf_path())
    assert from_gguf.config == model.config
    for (name, a), (_, b) in zip(
        from_gguf.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def _hf_config(**changes):
    data = {**TINY, "model_type": "llama", "eos_token_id": 2, **changes}
    return {k: v for k, v in data.items() if v is not None}


@pytest.mark.parametrize(
    "changes, word",
    [
        ({"model_type": "gpt_neox"}, "model_type 'gpt_neox'"),
        ({"model_type": "phi3", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        (
            {
                "model_type": "gemma3_text",
                "hidden_activation": "gelu_pytorch_tanh",
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 8.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            },
            r"rope_type 'linear'\['full_attention'\]",
        ),
        (
            {"model_type": "gemma2", "hidden_activation": "gelu"},
            "gemma2 config has hidden_act 'gelu'",
        ),
        (
            {"model_type": "gemma3_text", "use_bidirectional_attention": True},
            "use_bidirectional_attention",
        ),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_hf_features_are_refused_by_name(changes, word):
    with pytest.raises(DiffulexEdgeError, match=word):
        SDARConfig.from_dict(_hf_config(**changes))


def test_rope_theta_comes_from_either_place_and_defaults_like_transformers():
    assert SDARConfig.from_dict(_hf_config()).rope_theta == 5000.0
    nested = _hf_config(
        rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 7.0}
    )
    assert SDARConfig.from_dict(nested).rope_theta == 7.0
    assert SDARConfig.from_dict(_hf_config(rope_theta=None)).rope_theta == 10000.0


def test_a_llama_checkpoint_missing_a_tensor_names_it(tmp_path):
    _tiny_hf("llama", tie=True).save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", {"format": "pt"})
    with pytest.raises(
        DiffulexEdgeError, match=r"qk_norm=False.*missing.*layers\.1\.self_attn\.k_proj"
    ):
        load_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama"


def test_cli_exports_a_llama_directory_for_autoregressive_decoding(tmp_path, capsys):
    from diffulex_edge.cli import main
    from diffulex_edge.runtime import PteEngine

    hf = _tiny_hf("llama", tie=True)
    hf.save_pretrained(tmp_path / "llama")
    out = tmp_path / "llama.pte"
    assert main(["export", str(tmp_path / "llama"), "-o", str(out), "--max-seq", "64"]) == 0
    captured = capsys.readouterr()
    assert "block size 1, prefill chunk 32" in captured.out
    assert "4/4 write done" in captured.err  # the progress bar
    engine = PteEngine(out)
    assert (engine.layout.block_size, engine.meta["prefill_size"]) == (1, 32)
    ids = [5, 17, 3, 88, 41]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    config = GenerationConfig(max_new_tokens=6, stop_on_eos=False)
    assert engine.generate(ids, config).tokens == want[0, len(ids) :].tolist()


def test_a_transformers_4_gemma3_config_takes_its_layer_pattern_and_local_rope_base():
    """config.json written before transformers 5: no layer_types, rope_local_base_freq."""
    data = {
        **_hf_config(model_type="gemma3_text", num_hidden_layers=7, rope_theta=1e6),
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 16,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 8,
    }
    c = SDARConfig.from_dict(data)
    assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (c.rope_theta, c.rope_local_theta, c.sliding_window) == (1e6, 10000.0, 16)
    assert c.attention_scale == 8**-0.5 and c.embedding_multiplier == 32**0.5
