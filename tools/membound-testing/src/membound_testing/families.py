"""Tiny random-weights models of the families users run, built offline from config classes.

The support matrix (membound_testing.support) asserts each package's promise on every
family here. The configs keep each family's traits: sliding-window and full-attention
layers mixed (gemma2, gemma3_text, and the `hybrid` variants), GeGLU with gelu-tanh
(gemma2/3), q/k norms (qwen3, olmo2, gemma3_text), logit soft-capping (gemma2), tied
embeddings (llama, gemma2, smollm3: gemma3_text's are untied here, since its tiny tied
model repeats the last token under greedy decoding), and GQA ratios other than SmolLM2's 3 (4 and 1 below); the non-gated MLPs
(gpt_neox, phi, opt: fc1 / fc2, LLM in a Flash's own setting) are listed apart.

Every model is float32, eval mode, seeded, about 100-300 k parameters: a forward pass on
a few dozen tokens takes milliseconds.
"""

from __future__ import annotations

# Dense families users run (transformers model_type). SwiGLU unless said.
DENSE = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "smollm3",
)
# Non-gated MLPs (fc1 -> act -> fc2): GPT-NeoX, Phi-2, OPT.
NON_GATED = ("gpt_neox", "phi", "opt")

VOCAB = 128
HIDDEN = 64
LAYERS = 4
HEADS = 4
KV_HEADS = 1  # GQA ratio 4: SmolLM2 has 9 / 3
HEAD_DIM = 16
INTER = 96
# Larger than the families' 0.02: at 0.02 (and 0.1) most tiny models repeat one token under
# greedy decoding, and a test comparing two caches' tokens would compare constants.
INIT_RANGE = 0.3
WINDOW = 8  # sliding window of the hybrid families: shorter than the tests' sequences

# Per-family config keys beyond the shared ones.
_EXTRA = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": HEAD_DIM,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma3_text": {
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": HEAD_DIM,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
    },
    "phi3": {},
    "olmo2": {},
    "granite": {"embedding_multiplier": 2.0, "logits_scaling": 4.0, "residual_multiplier": 0.5},
    "smollm3": {"no_rope_layer_interval": 2},
    "gpt_neox": {},
    "phi": {},
    "opt": {},
}


def config(family: str, **overrides):
    """The transformers config of a tiny ``family`` model (``AutoConfig.for_model``).

    Args:
        family: a transformers ``model_type`` from :data:`DENSE` or :data:`NON_GATED`.
        **overrides: config keys to set or replace (e.g. ``num_key_value_heads=4``).

    Returns:
        A ``PretrainedConfig`` of that family.

    Raises:
        KeyError: ``family`` is not one listed here.
    """
    from transformers import AutoConfig

    if family not in _EXTRA:
        raise KeyError(f"no tiny config for family {family!r}; known: {sorted(_EXTRA)}")
    if family == "gpt_neox":
        base = {
            "hidden_size": HIDDEN,
            "num_attention_heads": HEADS,
            "intermediate_size": INTER,
            "rotary_pct": 0.5,
        }
    elif family == "opt":
        base = {
            "hidden_size": HIDDEN,
            "num_attention_heads": HEADS,
            "ffn_dim": INTER,
            "word_embed_proj_dim": HIDDEN,
            "max_position_embeddings": 256,
        }
    elif family == "phi":
        base = {
            "hidden_size": HIDDEN,
            "num_attention_heads": HEADS,
            "intermediate_size": INTER,
            "partial_rotary_factor": 0.5,
        }
    else:
        base = {
            "hidden_size": HIDDEN,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "intermediate_size": INTER,
            "max_position_embeddings": 256,
            "tie_word_embeddings": family in ("gemma2", "smollm3", "llama"),
        }
    keys = {
        "vocab_size": VOCAB,
        "initializer_range": INIT_RANGE,
        # Special tokens inside the tiny vocabulary (the families' defaults lie past it).
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "num_hidden_layers": LAYERS,
        **base,
        **_EXTRA[family],
        **overrides,
    }
    return AutoConfig.for_model(family, **keys)


def tiny_model(family: str, seed: int = 0, **overrides):
    """A random-weights ``AutoModelForCausalLM`` of ``family`` (float32, eval mode, eager
    attention so that every family runs the same kernels).

    Args:
        family: see :func:`config`.
        seed: torch's seed for the weights.
        **overrides: config keys, as for :func:`config`.

    Returns:
        The model, on CPU.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = config(family, **overrides)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # from_config leaves some norms at ones and biases at zeros: perturb every parameter a
    # little so that a package that drops one (a norm weight, a bias) changes the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        if family.startswith("gemma"):
            # Gemma multiplies the embedding by sqrt(hidden): at INIT_RANGE the input token
            # would outweigh every layer and greedy decoding would repeat one token.
            model.get_input_embeddings().weight.div_(HIDDEN**0.5)
    return model.eval()
