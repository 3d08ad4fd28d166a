import pytest

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
    with pytest.raises(ValueError, match=word):
        tiny_config(**overrides)


def test_sdar_1p7b_shape():
    cfg = sdar_1p7b_config(num_hidden_layers=2)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (2048, 8, 128)
    assert cfg.num_kv_groups == 2
