"""A compressed model saves only through save_compressed (which round-trips) and refuses,
before changing anything, what it cannot do: a state_dict without its weights,
save_pretrained, a dtype or device move (#19 item 2)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from conftest import make_toy, tiny_llama

from zstd_linear import (
    CompressedLinear,
    compress_model,
    decompress_model,
    load_compressed,
    save_compressed,
)
from zstd_linear.pretrained import companion_path

IDS = torch.tensor([[1, 5, 9, 42, 7, 3]])


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


# Compressing only the Linear layers leaves SmolLM2-like tied lm_head plain: its
# save_compressed failed on the shared tensor before 0.4.0.
@pytest.fixture(params=[False, True], ids=["linears", "linears+embedding"])
def compressed(request):
    plain = tiny_llama()
    model = tiny_llama()
    compress_model(model, level=1, embeddings=request.param)
    return plain, model


def test_state_dict_refuses_naming_save_compressed(compressed, tmp_path):
    _, model = compressed
    with pytest.raises(RuntimeError, match=r"zstd_linear\.save_compressed") as info:
        model.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in str(info.value) or "embed_tokens" in str(
        info.value
    )
    with pytest.raises(RuntimeError, match="save_compressed"):
        torch.save(model.state_dict(), tmp_path / "m.pt")
    from safetensors.torch import save_model

    with pytest.raises(RuntimeError, match="save_compressed"):
        save_model(model, str(tmp_path / "m.safetensors"))
    assert list(tmp_path.iterdir()) == []


def test_save_pretrained_refuses_and_writes_nothing(compressed, tmp_path):
    _, model = compressed
    target = tmp_path / "hf"
    with pytest.raises(RuntimeError, match=r"zstd_linear\.save_compressed"):
        model.save_pretrained(target)
    assert not target.exists()


def test_save_compressed_round_trips_to_identical_logits(compressed, tmp_path):
    plain, model = compressed
    path = tmp_path / "tiny.zlin"
    save_compressed(model, path)
    loaded = load_compressed(path, policy="none")
    assert torch.equal(logits(loaded), logits(plain))
    # The tie survives: one parameter (a plain lm_head) or one set of frames.
    head, table = loaded.lm_head, loaded.model.embed_tokens
    if isinstance(table, torch.nn.Embedding):
        assert head.weight is table.weight
    else:
        assert head.encoded is table.encoded
    assert torch.equal(logits(model), logits(plain))


def test_the_companion_is_safetensors_with_every_tensor_64_byte_aligned(compressed, tmp_path):
    """A plain lm_head viewed from the companion's mapping sits where a fresh allocation
    would: the GEMV kernel's rounding depends on the address mod 64 (0.9 left it at
    safetensors' 8-byte offsets, and one-row logits differed in the last bits)."""
    from safetensors.torch import load_file

    from zstd_linear.aligned_safetensors import PAD_PREFIX

    plain, model = compressed
    path = tmp_path / "tiny.zlin"
    save_compressed(model, path)
    state = load_file(companion_path(path))  # safetensors' own reader takes it
    assert torch.equal(state["model.norm.weight"], plain.model.norm.weight)
    assert all(not state[k].any() for k in state if k.startswith(PAD_PREFIX))
    loaded = load_compressed(path)
    assert PAD_PREFIX not in str(dict(loaded.named_parameters()))
    for name, param in loaded.named_parameters():
        assert param.data_ptr() % 64 == 0, name


def test_the_attention_implementation_round_trips(tmp_path):
    """The config's JSON leaves it out, and eager and sdpa round differently; a companion
    written before 0.10 (no record) gets transformers' default, as before."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from zstd_linear.aligned_safetensors import PAD_PREFIX
    from zstd_linear.pretrained import ATTN_KEY

    model = tiny_llama()
    model.config._attn_implementation = "eager"
    compress_model(model, level=1)
    path = tmp_path / "tiny.zlin"
    save_compressed(model, path)
    assert load_compressed(path).config._attn_implementation == "eager"
    companion = companion_path(path)
    with safe_open(str(companion), framework="pt") as f:
        metadata = {k: v for k, v in f.metadata().items() if k != ATTN_KEY}
        names = [k for k in f.keys() if not k.startswith(PAD_PREFIX)]  # noqa: SIM118
        tensors = {k: f.get_tensor(k) for k in names}
    save_file(tensors, str(companion), metadata=metadata)
    old = load_compressed(path)
    assert old.config._attn_implementation == "sdpa"
    assert torch.allclose(logits(old), logits(model), atol=1e-5)


def test_a_toy_models_state_dict_refuses_too():
    model = make_toy()
    compress_model(model, level=1)
    with pytest.raises(RuntimeError, match=r"blocks\.0\.q_proj\.weight.*save_compressed"):
        model.state_dict()


@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.to("meta"),
        lambda m: m.model.to(torch.float16),  # a submodule above a compressed layer
        lambda m: m.model.layers[1].mlp.up_proj.to(torch.bfloat16),  # the layer itself
    ],
    ids=["to-bf16", "half", "to-meta", "submodule", "layer"],
)
def test_dtype_and_device_moves_are_refused_before_anything_changes(compressed, move):
    plain, model = compressed
    before = {n: (p.dtype, p.device) for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="decodes only to its stored dtype, on the CPU") as info:
        move(model)
    assert "decompress_model" in str(info.value)
    assert {n: (p.dtype, p.device) for n, p in model.named_parameters()} == before
    assert torch.equal(logits(model), logits(plain))


def test_moves_that_change_nothing_work(compressed):
    plain, model = compressed
    assert model.to(torch.float32) is model
    model.to("cpu")
    model.float()
    assert torch.equal(logits(model), logits(plain))


def test_a_stand_alone_layer_refuses_a_move_and_a_state_dict():
    torch.manual_seed(0)
    layer = CompressedLinear.from_linear(torch.nn.Linear(8, 4), name="l")
    with pytest.raises(RuntimeError, match=r"'l'.*float32"):
        layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.float32
    with pytest.raises(RuntimeError, match="save_compressed"):
        pickle.dumps(layer.state_dict())


def test_decompress_model_lifts_the_refusals(compressed, tmp_path):
    plain, model = compressed
    decompress_model(model)
    assert torch.equal(logits(model), logits(plain))
    assert set(model.state_dict()) == set(plain.state_dict())
    model.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    model.to(torch.bfloat16)
    assert model.model.norm.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_output_files_follow_the_umask(compressed, tmp_path, umask):
    _, model = compressed
    old = os.umask(umask)
    try:
        save_compressed(model, tmp_path / "tiny.zlin")
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    for name in ("tiny.zlin", "tiny.zlin.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == expected, name
