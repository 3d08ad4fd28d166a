"""The pass-key retrieval prompt, llama.cpp's protocol."""

from __future__ import annotations

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "What is the pass key? The pass key is"


def passkey_prompt(tokenizer, n_tokens: int, key: int, depth: float) -> str:
    """Filler of about ``n_tokens`` tokens with the key line inserted at ``depth`` (0..1)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    per_filler = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    n_filler = max(1, n_tokens // per_filler)
    at = round(n_filler * depth)
    line = f"The pass key is {key}. Remember it. {key} is the pass key. "
    body = FILLER * at + line + FILLER * (n_filler - at)
    return (
        "There is an important info hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about the important information there.\n"
        + body
        + "\n"
        + QUESTION
    )
