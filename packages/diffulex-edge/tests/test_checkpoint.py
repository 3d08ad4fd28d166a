import json
import math
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diffulex_edge import DiffulexEdgeError
from diffulex_edge.checkpoint import (
    INTEGRITY_FILE,
    expected_shapes,
    load_checkpoint,
    save_checkpoint,
    write_integrity_record,
)
from diffulex_edge.config import tiny_config
from diffulex_edge.model import SDARModel


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
    # The record save_checkpoint wrote covers model.safetensors, which is gone: refused.
    with pytest.raises(DiffulexEdgeError, match=r"diffulex_integrity\.json names"):
        load_checkpoint(tmp_path)
    (tmp_path / INTEGRITY_FILE).unlink()  # now a foreign (Hugging Face) checkpoint
    loaded = load_checkpoint(tmp_path)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)
    write_integrity_record(tmp_path, ["config.json", "model.safetensors.index.json", *shards])
    loaded = load_checkpoint(tmp_path)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def _rewrite(tmp_path, edit):
    """Rewrite the weights as a foreign tool would: no integrity record."""
    (tmp_path / INTEGRITY_FILE).unlink(missing_ok=True)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


def test_missing_tensor_is_an_error(model, tmp_path):
    save_checkpoint(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.0.self_attn.q_norm.weight"))
    with pytest.raises(DiffulexEdgeError, match=r"missing.*q_norm"):
        load_checkpoint(tmp_path)


def test_wrong_shape_is_an_error(model, tmp_path):
    save_checkpoint(model, tmp_path)
    _rewrite(tmp_path, lambda t: t.__setitem__("model.norm.weight", torch.ones(3)))
    with pytest.raises(DiffulexEdgeError, match=r"model\.norm\.weight has shape"):
        load_checkpoint(tmp_path)


def test_missing_config_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_checkpoint(tmp_path)


def _edit_config(directory, **changes):
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _edit_header(path, edit):
    """Rewrite one field of a safetensors header in place (length prefix recomputed)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n :])


def test_expected_shapes_match_the_model():
    for cfg in (tiny_config(), tiny_config(tie_word_embeddings=True, num_hidden_layers=3)):
        with torch.device("meta"):
            skeleton = SDARModel(cfg)
        got = {
            (n if n.startswith("lm_head.") else f"model.{n}"): tuple(p.shape)
            for n, p in skeleton.named_parameters(remove_duplicate=False)
        }
        assert expected_shapes(cfg) == got


def test_save_writes_an_integrity_record_that_catches_a_flipped_weight_byte(model, tmp_path):
    save_checkpoint(model, tmp_path)
    record = json.loads((tmp_path / INTEGRITY_FILE).read_text())
    assert set(record["files"]) == {"config.json", "model.safetensors"}
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's bytes: the header still validates
    path.write_bytes(bytes(data))
    with pytest.raises(DiffulexEdgeError, match=r"model\.safetensors does not match the SHA-256"):
        load_checkpoint(tmp_path)


def test_huge_num_hidden_layers_is_refused_before_building(model, tmp_path):
    """Issue #15: "num_hidden_layers": 2**40 hung building the skeleton."""
    save_checkpoint(model, tmp_path)
    _edit_config(tmp_path, num_hidden_layers=2**40)
    with pytest.raises(DiffulexEdgeError, match=r"config\.json .*changed after it was written"):
        load_checkpoint(tmp_path)
    (tmp_path / INTEGRITY_FILE).unlink()
    with pytest.raises(DiffulexEdgeError, match=r"config\.json: num_hidden_layers must be in"):
        load_checkpoint(tmp_path)
    # In range but not what the tensors hold: refused before a model is built.
    _edit_config(tmp_path, num_hidden_layers=1000)
    with pytest.raises(DiffulexEdgeError, match=r"does not match its config \(1000 layers\)"):
        load_checkpoint(tmp_path)


def test_same_size_dtype_swap_is_refused(model, tmp_path):
    """Issue #15: F32 -> I32 in a header loaded with every weight converted."""
    save_checkpoint(model, tmp_path)
    (tmp_path / INTEGRITY_FILE).unlink()

    def to_i32(header):
        header["model.norm.weight"]["dtype"] = "I32"

    _edit_header(tmp_path / "model.safetensors", to_i32)
    with pytest.raises(DiffulexEdgeError, match=r"model\.norm\.weight in .* is I32.* F32"):
        load_checkpoint(tmp_path)
    # With no torch_dtype in config.json the tensors must still agree with each other.
    config = json.loads((tmp_path / "config.json").read_text())
    del config["torch_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DiffulexEdgeError, match=r"model\.norm\.weight in .* is I32"):
        load_checkpoint(tmp_path)


def test_string_tie_word_embeddings_is_refused(model, tmp_path):
    """Issue #15: "tie_word_embeddings": "no" tied lm_head and dropped the saved one."""
    save_checkpoint(model, tmp_path)
    (tmp_path / INTEGRITY_FILE).unlink()
    _edit_config(tmp_path, tie_word_embeddings="no")
    with pytest.raises(DiffulexEdgeError, match=r"config\.json: tie_word_embeddings must be true"):
        load_checkpoint(tmp_path)


def test_tied_config_with_a_different_saved_lm_head_is_refused(model, tmp_path):
    save_checkpoint(model, tmp_path)
    (tmp_path / INTEGRITY_FILE).unlink()
    _edit_config(tmp_path, tie_word_embeddings=True)
    with pytest.raises(DiffulexEdgeError, match=r"lm_head\.weight .* differs from"):
        load_checkpoint(tmp_path)


def test_tied_checkpoint_round_trips(tmp_path):
    from random_sdar import random_model

    tied = random_model(tiny_config(tie_word_embeddings=True), seed=1)
    save_checkpoint(tied, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    torch.testing.assert_close(loaded.lm_head.weight, tied.embed_tokens.weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h["model.norm.weight"].update(data_offsets=[0, 128]), "overlap or leave a gap"),
        (lambda h: h["model.norm.weight"].update(shape=[8, 4]), r"model\.norm\.weight has shape"),
        (lambda h: h["model.norm.weight"].update(shape=[64]), "its data_offsets span"),
        (lambda h: h["model.norm.weight"].update(dtype="F33"), "has dtype 'F33'"),
        (lambda h: h["model.norm.weight"].update(data_offsets=[-4, 124]), "data_offsets"),
    ],
)
def test_bad_safetensors_headers_are_refused_naming_the_tensor(model, tmp_path, edit, match):
    save_checkpoint(model, tmp_path)
    (tmp_path / INTEGRITY_FILE).unlink()
    _edit_header(tmp_path / "model.safetensors", edit)
    with pytest.raises(DiffulexEdgeError, match=match):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, True, "1e-6"])
def test_bad_float_fields_in_config_json_are_refused(model, tmp_path, value):
    save_checkpoint(model, tmp_path)
    (tmp_path / INTEGRITY_FILE).unlink()
    _edit_config(tmp_path, rms_norm_eps=value)
    with pytest.raises(DiffulexEdgeError, match=r"config\.json: rms_norm_eps"):
        load_checkpoint(tmp_path)
