"""The SmolLM2 float copy every environment reads: one tokenizer, whatever made the copy.

transformers 5.2 (the kvpress environment's) converts the GGUF's tokenizer as a Llama
SentencePiece one (eos "<|im_start|>", a "<|im_start|>" prepended to every text). A copy
made there, then read by the other environments, answered "L'Étoile, la Marsebeau, ..."
instead of "Paris" under the budget runner, and made bmrt-kv's and kvpress's samples differ.
"""

import json
from types import SimpleNamespace

import pytest

from membound_testing import models


class _Tokenizer:
    def __init__(self, eos, ids):
        self.eos_token, self._ids = eos, ids

    def __call__(self, text):
        return SimpleNamespace(input_ids=list(self._ids))


def test_the_canonical_tokenizer_passes_and_a_misconverted_one_is_refused():
    models.check_smollm2_tokenizer(_Tokenizer("<|im_end|>", [38634, 314, 2066]), "x")
    with pytest.raises(RuntimeError, match=r"eos '<\|im_start\|>' and encodes 'Paris is big'"):
        models.check_smollm2_tokenizer(_Tokenizer("<|im_start|>", [1, 38634, 314, 2066]), "x")
    with pytest.raises(RuntimeError, match=r"as \[1, 38634, 314, 2066\]"):
        models.check_smollm2_tokenizer(_Tokenizer("<|im_end|>", [1, 38634, 314, 2066]), "x")


def test_the_real_copy_has_the_canonical_tokenizer(smollm2):
    models.check_smollm2_tokenizer(smollm2[1], "the float copy")


@pytest.mark.parametrize("eos, refused", [("<|im_end|>", False), ("<|im_start|>", True)])
def test_a_cached_copy_with_another_tokenizer_is_refused(tmp_path, monkeypatch, eos, refused):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 10)
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    monkeypatch.setenv("MEMBOUND_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / f"smollm2-135m-instruct-f32-v{models.CACHE_FORMAT}-10"
    target.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json"):
        (target / name).write_bytes(b"{}")
    (target / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    if refused:
        with pytest.raises(RuntimeError, match=r"its tokenizer has eos '<\|im_start\|>'"):
            models.smollm2_float_dir()
    else:
        assert models.smollm2_float_dir() == target
