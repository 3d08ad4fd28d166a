"""The synthetic digit-sorting task the toy SDAR model (``checkpoints/sort8`` beside this
file) is trained on: its tests, the decode benchmark and ``train_sort.py`` use it. Not in the
wheel (#56): run from a repository checkout, with this folder on ``sys.path``.

Prompt: ``d_1 .. d_n SEP`` (n random digits); answer: the digits sorted ascending, then
``EOS``; training pads the sequence to whole blocks with EOS (as SDAR's SFT pads with its
end-of-text token), so a decoded block after the answer is all EOS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diffulex_edge.backends import Backend
from diffulex_edge.generate import GenerationConfig, generate

HERE = Path(__file__).resolve().parent

DIGITS = 10
SEP = 10
EOS = 11
MASK = 12
VOCAB_SIZE = 16  # 13 used; rounded up so the embedding rows stay aligned
TRAINED = "sort8"


def trained_checkpoint() -> Path:
    """The tiny SDAR model trained on 8-digit sorting (``benchmarks/train_sort.py``).

    Returns:
        Its checkpoint directory, ``benchmarks/checkpoints/sort8``.
    """
    return HERE / "checkpoints" / TRAINED


@dataclass(frozen=True)
class SortTask:
    num_digits: int = 8
    block_size: int = 4

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ValueError(f"num_digits must be >= 1, got {self.num_digits}")

    @property
    def prompt_len(self) -> int:
        return self.num_digits + 1

    @property
    def seq_len(self) -> int:
        """Prompt + answer + EOS, rounded up to whole blocks."""
        raw = 2 * self.num_digits + 2
        return -(-raw // self.block_size) * self.block_size

    def sample(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """(batch, seq_len) int64 full sequences: prompt, sorted digits, EOS padding."""
        digits = torch.randint(0, DIGITS, (batch, self.num_digits), generator=generator)
        seq = torch.full((batch, self.seq_len), EOS, dtype=torch.long)
        seq[:, : self.num_digits] = digits
        seq[:, self.num_digits] = SEP
        seq[:, self.prompt_len : self.prompt_len + self.num_digits] = digits.sort(dim=1).values
        return seq

    def expected(self, prompt: list[int]) -> list[int]:
        return sorted(prompt[: self.num_digits])


def encode(digits: str) -> list[int]:
    """``"31415"`` -> prompt ids ``[3, 1, 4, 1, 5, SEP]``.

    Args:
        digits: a non-empty string of decimal digits.

    Returns:
        The prompt's token ids, the separator last.

    Raises:
        ValueError: ``digits`` is empty or holds a non-digit.
    """
    if not digits or not digits.isdigit():
        raise ValueError(f"prompt must be a non-empty string of digits, got {digits!r}")
    return [int(c) for c in digits] + [SEP]


def decode(ids: list[int]) -> str:
    """Ids -> text: digits as themselves, other ids in angle brackets.

    Args:
        ids: token ids of the sorting vocabulary.

    Returns:
        The text, e.g. ``"1134<eos>"``.
    """
    names = {SEP: "|", EOS: "<eos>", MASK: "<mask>"}
    return "".join(str(i) if i < DIGITS else names.get(i, f"<{i}>") for i in ids)


@dataclass
class DecodeRun:
    tokens_per_s: float
    tokens_per_forward: float
    tokens_per_forward_with_commits: float
    exact_match: float


def run_sort_task(
    backend: Backend, prompts: list[list[int]], config: GenerationConfig, mask_id: int, eos_id: int
) -> DecodeRun:
    """Decode every prompt; tokens/s counts decoded tokens over wall time, prefill included.

    Args:
        backend: the model's forward (eager or a .pte's).
        prompts: prompt ids, each ``num_digits`` digits and the separator.
        config: the generation settings.
        mask_id: the mask token's id.
        eos_id: the end-of-sequence token's id.

    Returns:
        :class:`DecodeRun`: tokens/s, tokens per forward and the exact-match share.
    """
    task = SortTask()
    decoded = denoise = commits = correct = 0
    start = time.perf_counter()
    for prompt in prompts:
        r = generate(backend, prompt, config, mask_id, eos_id)
        decoded += r.decoded_tokens
        denoise += r.denoise_forwards
        commits += r.commit_forwards
        correct += r.tokens == task.expected(prompt)
    seconds = time.perf_counter() - start
    return DecodeRun(
        tokens_per_s=decoded / seconds,
        tokens_per_forward=decoded / max(denoise, 1),
        tokens_per_forward_with_commits=decoded / max(denoise + commits, 1),
        exact_match=correct / len(prompts),
    )


def sort_prompts(n: int, seed: int = 1234) -> list[list[int]]:
    """Seeded random prompts of the 8-digit task.

    Args:
        n: how many.
        seed: the generator's seed; the same seed gives the same prompts.

    Returns:
        ``n`` prompts, each 8 digits and the separator.
    """
    task = SortTask()
    seqs = task.sample(n, torch.Generator().manual_seed(seed))
    return [s[: task.prompt_len].tolist() for s in seqs]
