"""Pass-key retrieval evaluation (llama.cpp's protocol) with a bounded or a full cache."""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from bmrt_kv.config import BMRTConfig
from bmrt_kv.errors import BMRTError
from bmrt_kv.hooks import cache_keyword
from bmrt_kv.stream import BoundedStream

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n"
)
QUESTION = "What is the pass key? The pass key is"


@dataclass
class Sample:
    """One retrieval item: ``context`` is streamed, then ``question`` is asked.

    ``answer`` is the expected answer (the first, for tasks with several). With
    ``answers`` empty (the pass key), an output is correct when its first number is
    ``answer``; otherwise when every one of ``answers`` appears in it as a whole word
    (RULER's ``string_match_all``, all or nothing). ``task`` names the generator and
    ``max_new_tokens`` is how long an answer may be.
    """

    context: str
    question: str
    answer: str
    answers: tuple[str, ...] = ()
    task: str = "passkey"
    max_new_tokens: int = 8

    def correct(self, output: str) -> bool:
        if not self.answers:
            return first_number(output) == self.answer
        words = set(re.findall(r"\w+", output.lower()))
        return all(a.lower() in words for a in self.answers)


def passkey_sample(tokenizer, n_tokens: int, key: int, depth: float) -> Sample:
    """Filler of about ``n_tokens`` tokens with the key line at ``depth`` in [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise BMRTError(f"depth must be in [0, 1], got {depth}")
    n_filler = max(1, n_tokens // len(tokenizer(FILLER, add_special_tokens=False).input_ids))
    at = round(n_filler * depth)
    line = f"The pass key is {key}. Remember it. {key} is the pass key. "
    body = FILLER * at + line + FILLER * (n_filler - at)
    return Sample(INTRO + body + "\n", QUESTION, str(key))


def multikey_sample(tokenizer, n_tokens: int, keys: dict[str, int], ask: str, rng) -> Sample:
    """Several "The pass key of NAME is N." lines at random depths; ask for one name."""
    if ask not in keys:
        raise BMRTError(f"ask must be one of {sorted(keys)}, got {ask!r}")
    n_filler = max(1, n_tokens // len(tokenizer(FILLER, add_special_tokens=False).input_ids))
    slots = sorted(rng.sample(range(n_filler + 1), len(keys)))
    parts, last = [], 0
    for slot, (name, value) in zip(slots, keys.items(), strict=True):
        parts.append(FILLER * (slot - last))
        parts.append(f"The pass key of {name} is {value}. Remember it. ")
        last = slot
    parts.append(FILLER * (n_filler - last))
    question = f"What is the pass key of {ask}? The pass key of {ask} is"
    return Sample(INTRO + "".join(parts) + "\n", question, str(keys[ask]))


def first_number(text: str) -> str | None:
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


@torch.inference_mode()
def run_sample(
    model: nn.Module,
    tokenizer,
    sample: Sample,
    config: BMRTConfig | None,
    block_size: int = 512,
    max_new_tokens: int | None = None,
) -> dict:
    """Stream ``sample`` and answer greedily; ``config=None`` runs the full DynamicCache.
    ``max_new_tokens`` defaults to the sample's own.

    Returns a dict with ``correct`` (:meth:`Sample.correct`), ``output``,
    ``prefill_tokens_per_s``, ``decode_tokens_per_s`` and ``peak_kv_bytes``.
    """
    max_new_tokens = sample.max_new_tokens if max_new_tokens is None else max_new_tokens
    if config is None:
        return _run_full(model, tokenizer, sample, block_size, max_new_tokens)
    question = sample.question if config.scoring == "query_aware" else None
    stream = BoundedStream(model, tokenizer, config, question=question)
    stream.feed(sample.context)
    new = stream.generate(sample.question, max_new_tokens)
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    stats = stream.stats
    return {
        "correct": sample.correct(text),
        "output": text,
        "prefill_tokens_per_s": stats.prefill_tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "peak_kv_bytes": stats.peak_kv_bytes,
    }


def _run_full(model, tokenizer, sample: Sample, block_size: int, max_new_tokens: int) -> dict:
    from transformers import DynamicCache

    ids = tokenizer(sample.context + sample.question, return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    given = {cache_keyword(model): cache}
    start = time.perf_counter()
    for block in ids.split(block_size, dim=-1):
        logits = model(input_ids=block, logits_to_keep=1, **given).logits
    prefill = time.perf_counter() - start
    new: list[int] = []
    start = time.perf_counter()
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        new.append(token)
        if token == tokenizer.eos_token_id:
            break
        logits = model(input_ids=torch.tensor([[token]]), logits_to_keep=1, **given).logits
    decode = time.perf_counter() - start
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return {
        "correct": sample.correct(text),
        "output": text,
        "prefill_tokens_per_s": ids.shape[-1] / prefill,
        "decode_tokens_per_s": len(new) / decode,
        "peak_kv_bytes": kv,
    }


def passkey_samples(tokenizer, n_tokens: int, count: int, seed: int = 0) -> list[Sample]:
    """``count`` samples with keys from ``seed`` and depths spread over 10..90%."""
    rng = random.Random(seed)
    depths = [0.1 + 0.8 * i / max(1, count - 1) for i in range(count)]
    return [passkey_sample(tokenizer, n_tokens, rng.randint(10000, 99999), d) for d in depths]
