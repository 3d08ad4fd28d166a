import math

import pytest

from diffulex_edge import DiffulexEdgeError
from diffulex_edge.config import SDARConfig, sdar_1p7b_config, tiny_config


def test_from_dict_ignores_unknown_keys_and_takes_first_eos():
    cfg = SDARConfig.from_dict(
        {**tiny_config().to_dict(), "architectures": ["SDARForCausalLM"], "eos_token_id": [5, 6]}
    )
    assert cfg.eos_token_id == 5
    assert cfg.head_dim == 8


def test_head_dim_defaults_to_hidden_over_heads():
    cfg = tiny_config(head_dim=None, hidden_size=48, num_attention_heads=4)
    assert cfg.head_dim == 12


@pytest.mark.parametrize(
    "overrides, word",
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"head_dim": 7}, "head_dim"),
        ({"mask_token_id": 64}, "mask_token_id"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ],
)
def test_bad_config_names_the_parameter(overrides, word):
    with pytest.raises(DiffulexEdgeError, match=word):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "name, value",
    [
        ("num_hidden_layers", 2**40),
        ("num_hidden_layers", True),
        ("num_hidden_layers", 2.0),
        ("vocab_size", "64"),
        ("vocab_size", 2**25),
        ("max_position_embeddings", 2**31),
        ("head_dim", 0),
        ("rms_norm_eps", math.nan),
        ("rms_norm_eps", math.inf),
        ("rms_norm_eps", True),
        ("rope_theta", -math.inf),
        ("rope_theta", None),
        ("tie_word_embeddings", "no"),
        ("tie_word_embeddings", 0),
        ("mask_token_id", True),
        ("mask_token_id", 62.0),
        ("eos_token_id", -1),
    ],
)
def test_wrong_types_and_ranges_are_refused(name, value):
    with pytest.raises(DiffulexEdgeError, match=name):
        tiny_config(**{name: value})


def test_from_dict_refuses_missing_fields_and_non_objects():
    data = tiny_config().to_dict()
    del data["hidden_size"]
    with pytest.raises(DiffulexEdgeError, match=r"missing.*hidden_size"):
        SDARConfig.from_dict(data)
    with pytest.raises(DiffulexEdgeError, match="JSON object"):
        SDARConfig.from_dict([1, 2])
    with pytest.raises(DiffulexEdgeError, match="eos_token_id"):
        SDARConfig.from_dict({**tiny_config().to_dict(), "eos_token_id": []})


def test_from_dict_accepts_int_valued_floats_as_hugging_face_writes_them():
    cfg = SDARConfig.from_dict({**tiny_config().to_dict(), "rope_theta": 1000000})
    assert cfg.rope_theta == 1000000


def test_sdar_1p7b_shape():
    cfg = sdar_1p7b_config(num_hidden_layers=2)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (2048, 8, 128)
    assert cfg.num_kv_groups == 2


def test_family_switches_at_their_defaults_leave_the_config_json_as_before():
    """Configs (and so program digests) written before the switches existed are unchanged."""
    assert set(tiny_config().to_dict()) == {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "mask_token_id",
        "eos_token_id",
        "qk_norm",
        "qkv_bias",
    }
    hybrid = tiny_config(
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], rope_layers=[1, 0]
    )
    data = hybrid.to_dict()
    assert data["layer_types"] == ["sliding_attention", "full_attention"]
    assert SDARConfig.from_dict(data) == hybrid


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"hidden_act": "gelu"}, "hidden_act must be one of"),
        ({"norm_layout": "middle"}, "norm_layout must be one of"),
        ({"layer_types": ["full_attention"]}, "layer_types must be a list of 2"),
        ({"layer_types": ["full_attention", "local"]}, r"layer_types holds \['local'\]"),
        ({"sliding_window": 4}, "no layer_types entry is 'sliding_attention'"),
        (
            {"layer_types": ["sliding_attention", "full_attention"]},
            "sliding_window must be an int",
        ),
        ({"rope_layers": [1, 2]}, "rope_layers must be a list of 2 entries"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be finite"),
        ({"residual_multiplier": float("nan")}, "residual_multiplier must be finite"),
    ],
)
def test_bad_family_switches_are_refused_by_name(changes, words):
    with pytest.raises(DiffulexEdgeError, match=words):
        tiny_config(**changes)
