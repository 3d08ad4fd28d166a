"""The support matrix (#55): zstd-linear's promise on a tiny random-weights model of every
family users run (membound_testing.families), compressed as the README shows.

Each family's logits must equal the plain model's bit for bit, after compress_model and
again after save_compressed / load_compressed(path), over a prefill longer than the
sliding window of gemma2 / gemma3_text and one cached decode step (one row of input: the
streamed lm_head's path when it is tied to a compressed embedding). Both forms the README
presents are covered: every untied Linear (the default) and Linear layers + embeddings
(``embeddings=True``, what ``zstd-linear compress`` does). No family is refused;
``tools/support_matrix.py`` renders the README table from the records.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from membound_testing.families import DENSE, NON_GATED, tiny_model
from membound_testing.support import record
from zstd_linear import (
    CompressedEmbedding,
    CompressedFileError,
    CompressedLinear,
    compress_model,
    compression_stats,
    load_compressed,
    save_compressed,
)
from zstd_linear.codec import CodecConfig, encode_weight
from zstd_linear.fileformat import write_file
from zstd_linear.model import RUNTIME_ATTR

PACKAGE = "zstd-linear"
FAMILIES = DENSE + NON_GATED
# 13 tokens of the tiny vocabulary (128): longer than the hybrid families' window (8).
PROMPT = torch.tensor([[1, 5, 9, 42, 7, 3, 100, 17, 64, 2, 11, 90, 33]])
NEXT = torch.tensor([[77]])
FORMS = {"linears": {}, "linears+embeddings": {"embeddings": True}}
# Embeddings whose class has its own forward stay plain under embeddings=True.
OWN_FORWARD = {
    "gemma2": {"model.embed_tokens": "Gemma2TextScaledWordEmbedding"},
    "gemma3_text": {"model.embed_tokens": "Gemma3TextScaledWordEmbedding"},
    "opt": {"model.decoder.embed_positions": "OPTLearnedPositionalEmbedding"},
}


def logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits (1, T, vocab), one cached decode step's logits (1, 1, vocab))."""
    with torch.inference_mode():
        out = model(PROMPT, use_cache=True)
        step = model(NEXT, past_key_values=out.past_key_values, use_cache=True)
    return out.logits, step.logits


def assert_identical(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), f"max |diff| {(g - w).abs().max().item():.3g}"


def plain_linears(model) -> set[str]:
    return {n for n, m in model.named_modules() if type(m) is nn.Linear}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(family, the plain model's logits)."""
    return request.param, logits(tiny_model(request.param))


@pytest.mark.parametrize("form", FORMS)
def test_logits_are_bit_identical_and_round_trip(family, form, tmp_path):
    name, reference = family
    model = tiny_model(name)
    report = compress_model(model, **FORMS[form])
    # A Linear left plain (tied to a plain embedding) is reported, with its reason.
    assert plain_linears(model) <= set(report.skipped)
    # Two passes: per_pass_prefetch records the layer order on the first and prefetches on
    # the second.
    assert_identical(logits(model), reference)
    assert_identical(logits(model), reference)
    assert compression_stats(model).decompressions > 0
    record(PACKAGE, name, "bit-identical logits")

    path = tmp_path / f"{name}.zlin"
    save_compressed(model, path)
    loaded = load_compressed(path, policy="budget", budget_bytes=4096)
    assert type(loaded).__name__ == type(model).__name__
    assert any(isinstance(m, CompressedLinear) for m in loaded.modules())
    assert_identical(logits(loaded), reference)
    assert_identical(logits(loaded), reference)
    record(PACKAGE, name, "save / load round-trip")


@pytest.mark.parametrize("name", FAMILIES)
def test_embeddings_with_their_own_forward_stay_plain(name):
    """embeddings=True compresses every plain lookup and reports the rest by class."""
    model = tiny_model(name)
    tables = {n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    report = compress_model(model, embeddings=True)
    plain = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    assert plain == OWN_FORWARD.get(name, {})
    for table, cls in plain.items():
        assert cls in report.skipped[table]
    compressed = {n for n, m in model.named_modules() if isinstance(m, CompressedEmbedding)}
    assert compressed == tables - set(plain)


def test_a_file_cannot_put_a_plain_lookup_in_place_of_a_scaled_embedding(tmp_path):
    """A .zlin embedding loaded into Gemma's scaled one would drop the scale: refused,
    naming the module and its class, before the model changes."""
    model = tiny_model("gemma2")
    reference = logits(model)
    table = model.model.embed_tokens.weight.detach()
    path = tmp_path / "embed.zlin"
    write_file(path, [("model.embed_tokens", encode_weight(table, CodecConfig(level=1)), None)])
    with pytest.raises(CompressedFileError, match="Gemma2TextScaledWordEmbedding") as info:
        load_compressed(path, model)
    assert "model.embed_tokens" in str(info.value)
    assert RUNTIME_ATTR not in model.__dict__
    assert type(model.model.embed_tokens).__name__ == "Gemma2TextScaledWordEmbedding"
    assert_identical(logits(model), reference)
