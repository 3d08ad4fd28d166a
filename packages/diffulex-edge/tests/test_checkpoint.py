import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diffulex_edge.checkpoint import load_checkpoint, save_checkpoint


def test_round_trip_in_hugging_face_layout(model, tmp_path):
    save_checkpoint(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    for name in (
        "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.self_attn.k_norm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert name in keys
    loaded = load_checkpoint(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    pos = torch.arange(5)[None]
    torch.testing.assert_close(loaded(ids, pos), model(ids, pos), rtol=0, atol=0)


def test_sharded_checkpoint_loads(model, tmp_path):
    save_checkpoint(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_checkpoint(tmp_path)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def _rewrite(tmp_path, edit):
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


def test_missing_tensor_is_an_error(model, tmp_path):
    save_checkpoint(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.0.self_attn.q_norm.weight"))
    with pytest.raises(ValueError, match=r"missing.*q_norm"):
        load_checkpoint(tmp_path)


def test_wrong_shape_is_an_error(model, tmp_path):
    save_checkpoint(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.norm.weight", torch.ones(3)))
    with pytest.raises(ValueError, match=r"model\.norm\.weight has shape"):
        load_checkpoint(tmp_path)


def test_missing_config_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_checkpoint(tmp_path)
