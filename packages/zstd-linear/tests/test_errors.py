"""Bad arguments raise ZstdLinearError (a ValueError) before anything changes; damaged
files raise its subclass CompressedFileError."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import make_toy

from zstd_linear import (
    CompressedFileError,
    CompressedLinear,
    ZstdLinearError,
    compress_model,
    compression_stats,
    decompress_model,
    load_compressed,
    save_compressed,
    set_policy,
)
from zstd_linear.codec import CodecConfig, encode_weight
from zstd_linear.decoder import DecodeError, Decoder

BAD_COMPRESS_ARGUMENTS = [
    ({"policy": "lru"}, "policy must be one of"),
    ({"policy": ["none"]}, "policy must be one of"),
    ({"policy": "budget", "budget_bytes": -1}, "budget_bytes must be an int >= 0"),
    ({"policy": "budget"}, "exactly one of budget_bytes"),
    ({"policy": "none", "window": 2}, "bad options"),
    ({"policy": "per_pass_prefetch", "window": 0}, "window must be"),
    ({"include": "blocks"}, r"must match an nn\.Linear"),
    ({"include": ["blocks.0.q_proj", 3]}, "include must be a glob string"),
    ({"exclude": "*"}, r"no nn\.Linear to compress"),
    ({"level": 99}, "level must be in 1..22"),
    ({"layout": "lz4"}, "layout"),
    ({"chunk_bytes": 100}, "chunk_bytes"),
    ({"raw_below": 1.0}, "raw_below"),
    ({"threads": 0}, "threads must be an int >= 1"),
]


def snapshot(model: nn.Module) -> list[tuple[str, type, list[torch.Tensor]]]:
    return [
        (name, type(m), [p.detach().clone() for p in m.parameters(recurse=False)])
        for name, m in model.named_modules()
    ]


def assert_unchanged(model: nn.Module, before) -> None:
    after = snapshot(model)
    assert [(n, t) for n, t, _ in after] == [(n, t) for n, t, _ in before]
    for (_, _, new), (_, _, old) in zip(after, before, strict=True):
        assert len(new) == len(old) and all(map(torch.equal, new, old))


def test_the_error_types_nest():
    assert issubclass(ZstdLinearError, ValueError)
    assert issubclass(CompressedFileError, ZstdLinearError)
    assert issubclass(DecodeError, CompressedFileError)


@pytest.mark.parametrize(("kwargs", "message"), BAD_COMPRESS_ARGUMENTS)
def test_bad_compress_arguments_raise_the_package_error_and_leave_the_model_unchanged(
    kwargs, message
):
    model = make_toy()
    before = snapshot(model)
    with pytest.raises(ZstdLinearError, match=message) as info:
        compress_model(model, **kwargs)
    assert not isinstance(info.value, CompressedFileError)  # an argument, not a file
    assert_unchanged(model, before)
    assert "zstd_linear_runtime" not in model.__dict__


def test_an_unsupported_embedding_is_refused_before_anything_changes():
    model = make_toy()
    model.embed = nn.Embedding(10, 32, max_norm=1.0)
    before = snapshot(model)
    with pytest.raises(ZstdLinearError, match="max_norm"):
        compress_model(model, embeddings=True)
    assert_unchanged(model, before)


def test_bad_arguments_to_a_compressed_model_leave_it_unchanged(tmp_path):
    plain, model = make_toy(), make_toy()
    compress_model(model, policy="none")
    runtime = model.zstd_linear_runtime
    for call, message in [
        (lambda: set_policy(model, "lru"), "policy must be one of"),
        (lambda: set_policy(model, "budget", budget_bytes=-1), "budget_bytes"),
        (lambda: compress_model(model), "already compressed"),
        (lambda: load_compressed(tmp_path / "any.zlin", model), "already compressed"),
    ]:
        with pytest.raises(ZstdLinearError, match=message):
            call()
        assert model.zstd_linear_runtime is runtime
        assert runtime.policy.name == "none"
    x = torch.randn(2, 32)
    with torch.inference_mode():
        assert torch.equal(model(x), plain(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "lru"}, "policy must be one of"),
        ({"policy": ["none"]}, "policy must be one of"),
        ({"threads": 0}, "threads"),
    ],
)
def test_load_compressed_checks_its_arguments_before_reading_the_file(tmp_path, kwargs, message):
    source = make_toy()
    compress_model(source, level=1)
    path = tmp_path / "toy.zlin"
    save_compressed(source, path)
    model = make_toy(seed=1)
    before = snapshot(model)
    with pytest.raises(ZstdLinearError, match=message):
        load_compressed(path, model, **kwargs)
    assert_unchanged(model, before)
    # Not read at all: a missing file gives the same error, not FileNotFoundError.
    with pytest.raises(ZstdLinearError, match=message):
        load_compressed(tmp_path / "missing.zlin", model, **kwargs)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: CodecConfig(level=0), "level"),
        (lambda: encode_weight(torch.zeros(4, 4, dtype=torch.int32)), "dtype must be one of"),
        (lambda: encode_weight(torch.zeros(4)), "2-D"),
        (lambda: Decoder(0), "threads"),
        (lambda: Decoder(1, backend="gpu"), "backend must be one of"),
        (lambda: CompressedLinear.from_linear(nn.Embedding(4, 4)), r"must be an nn\.Linear"),
        (lambda: decompress_model(make_toy()), "not compressed"),
        (lambda: compression_stats(make_toy()), "not compressed"),
    ],
)
def test_building_blocks_raise_the_package_error(call, message):
    with pytest.raises(ZstdLinearError, match=message):
        call()
