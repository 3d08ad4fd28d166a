"""What one demo row reports, and the helpers rows share."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from membound_testing.budget.runner import storage_read_bytes

QUESTION = "What is the capital of France?"
ANSWER = "Paris"


@dataclass
class Row:
    """One line of the demo table.

    ``resident_bytes`` is what the bounded component (named by ``component``) holds
    with the package; ``unbounded_bytes`` what the same component holds without it.
    ``correct`` says whether the output is the expected answer (the budget runner counts
    a wrong answer as a failure). ``new_tokens`` and ``decode_read_bytes`` are the tokens
    generated and the bytes read from storage while generating them.
    """

    name: str
    output: str
    tokens_per_s: float
    correct: bool
    component: str = ""
    resident_bytes: int | None = None
    unbounded_bytes: int | None = None
    new_tokens: int | None = None
    decode_read_bytes: int | None = None
    peak_rss_bytes: int | None = None  # filled in by the demo's row process

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    text: str
    tokens_per_s: float
    new_tokens: int
    read_bytes: int  # from storage, during generation

    def row_fields(self) -> dict:
        """The Row fields a generation fills in."""
        return {
            "output": self.text,
            "tokens_per_s": self.tokens_per_s,
            "correct": ANSWER in self.text,
            "new_tokens": self.new_tokens,
            "decode_read_bytes": self.read_bytes,
        }


def greedy_generate(
    model, tokenizer, prompt: str, max_new_tokens: int = 24, **kwargs
) -> Generation:
    """Greedy generation of ``prompt``, timed, with the bytes read from storage meanwhile.

    A two-token generation runs first, untimed: the timed one is the steady state, not the
    first touch of weights that a fresh process (or a dropped page cache) has not read
    yet. Where a memory limit is below the weights, the steady state still pages. A cache
    passed as ``past_key_values`` is kept for the timed run (the warm-up gets its own).
    """
    import torch

    ids = tokenizer(prompt, return_tensors="pt")
    warm = {k: v for k, v in kwargs.items() if k != "past_key_values"}
    with torch.inference_mode():
        model.generate(**ids, max_new_tokens=2, do_sample=False, **warm)
    read = storage_read_bytes()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    seconds = time.perf_counter() - start
    read = storage_read_bytes() - read
    new = out[0, ids.input_ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    return Generation(text, len(new) / seconds, len(new), read)
