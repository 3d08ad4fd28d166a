"""What one demo row reports, and the helpers rows share."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

QUESTION = "What is the capital of France?"


@dataclass
class Row:
    """One line of the demo table.

    ``resident_bytes`` is what the bounded component (named by ``component``) holds
    with the package; ``unbounded_bytes`` what the same component holds without it.
    """

    name: str
    output: str
    tokens_per_s: float
    component: str = ""
    resident_bytes: int | None = None
    unbounded_bytes: int | None = None
    peak_rss_bytes: int | None = None  # filled in by the demo's row process

    def to_dict(self) -> dict:
        return asdict(self)


def greedy_generate(model, tokenizer, prompt: str, max_new_tokens: int = 24, **kwargs):
    """Greedy generation of ``prompt``; returns (new text, new tokens per second)."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    seconds = time.perf_counter() - start
    new = out[0, ids.input_ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    return text, len(new) / seconds
