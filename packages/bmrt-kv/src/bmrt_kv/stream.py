"""Streaming API: feed text or token chunks of any total length, then ask or generate."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from bmrt_kv.cache import BMRTCache
from bmrt_kv.config import BMRTConfig
from bmrt_kv.errors import BMRTError
from bmrt_kv.hooks import cache_keyword


@dataclass
class StreamStats:
    """What a stream has done: tokens fed/generated, seconds spent, peak KV bytes."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    peak_kv_bytes: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class BoundedStream:
    """A model reading an unbounded stream through a :class:`BMRTCache`.

    ``feed`` splits its input into blocks of ``block_size`` tokens (minus the question
    length in query-aware mode, so a forward never passes ``block_size``), ``generate``
    decodes greedily, and the cache compresses after every block and every step.

    Args:
        model: a supported causal LM in eval mode.
        tokenizer: its tokenizer (needed for text input and :meth:`ask`).
        config: the cache configuration.
        question: the known question for ``scoring="query_aware"`` (text or token ids).
        progress: show a progress bar over blocks.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        config: BMRTConfig | None = None,
        question: str | list[int] | None = None,
        progress: bool = False,
    ) -> None:
        self.config = config or BMRTConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.progress = progress
        self.question_ids = self._question_ids(question)
        if self.question_ids is None:
            self.cache = BMRTCache(model, self.config)
        else:
            self.cache = BMRTCache._with_question(model, self.config)
        self._cache_keyword = cache_keyword(model)
        self.stats = StreamStats()
        self._next_logits: torch.Tensor | None = None
        # The last generated token: fed (and cached) only if the stream goes on, so a
        # finished generate() costs no extra forward.
        self._pending: int | None = None

    def _question_ids(self, question) -> torch.Tensor | None:
        if self.config.scoring == "agnostic":
            if question is not None:
                raise BMRTError(
                    "question= is only used by scoring='query_aware'; with scoring="
                    "'agnostic' it would be ignored"
                )
            return None
        if question is None:
            raise BMRTError("scoring='query_aware' needs question=<text or token ids>")
        ids = self._encode(question, special=False)
        if not 0 < ids.shape[-1] < self.config.block_tokens:
            raise BMRTError(
                f"the question has {ids.shape[-1]} tokens; query-aware scoring needs "
                f"1 <= tokens < block_size={self.config.block_tokens}"
            )
        return ids

    def _encode(self, data, special: bool) -> torch.Tensor:
        if isinstance(data, str):
            if self.tokenizer is None:
                raise BMRTError("text input needs a tokenizer; pass tokenizer= or token ids")
            ids = self.tokenizer(data, add_special_tokens=special).input_ids
        elif isinstance(data, torch.Tensor):
            ids = data.reshape(-1).tolist()
        else:
            ids = list(data)
        return torch.tensor([ids], dtype=torch.long, device=self.model.device)

    @torch.inference_mode()
    def feed(self, data: str | list[int] | torch.Tensor) -> int:
        """Read ``data`` through the cache, block by block.

        Args:
            data: text (the first feed adds the tokenizer's special tokens), or token ids,
                a list or a (T,) / (1, T) int64 tensor.

        Returns:
            The number of tokens fed.

        Raises:
            BMRTError: text without a tokenizer.
        """
        self._flush_pending()
        ids = self._encode(data, special=self.cache.get_seq_length() == 0)
        n_question = 0 if self.question_ids is None else self.question_ids.shape[-1]
        step = self.config.block_tokens - n_question
        blocks = ids.split(step, dim=-1)
        if self.progress:
            from tqdm.auto import tqdm

            blocks = tqdm(blocks, desc="blocks", unit="block")
        start = time.perf_counter()
        for block in blocks:
            self._next_logits = self._forward(block, n_question)
        self.stats.prefill_seconds += time.perf_counter() - start
        self.stats.prefill_tokens += ids.shape[-1]
        self._track_peak()
        return ids.shape[-1]

    def _forward(self, block: torch.Tensor, n_question: int) -> torch.Tensor:
        """One forward; returns the (vocab,) logits after the block's last real token."""
        if n_question:
            block = torch.cat([block, self.question_ids], dim=-1)
        self.cache.scoring_only_tokens = n_question
        try:
            out = self.model(
                input_ids=block, logits_to_keep=n_question + 1, **{self._cache_keyword: self.cache}
            )
        finally:
            self.cache.scoring_only_tokens = 0
        return out.logits[0, 0]

    @torch.inference_mode()
    def generate(self, prompt=None, max_new_tokens: int = 32) -> list[int]:
        """Feed ``prompt`` (optional) then decode greedily.

        Decoding stops at the tokenizer's EOS token; every step compresses again once
        the cache would pass the budget.

        Args:
            prompt: text or token ids, as :meth:`feed` takes; None continues from what was fed.
            max_new_tokens: the most tokens to decode, >= 1.

        Returns:
            The new token ids, the EOS token included when it ended the answer.

        Raises:
            BMRTError: a bad ``max_new_tokens``, or nothing fed yet.
        """
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1
        ):
            raise BMRTError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if prompt is not None:
            self.feed(prompt)
        self._flush_pending()
        if self._next_logits is None:
            raise BMRTError("nothing to continue from: feed() some input first")
        eos = getattr(self.tokenizer, "eos_token_id", None)
        new: list[int] = []
        start = time.perf_counter()
        for step in range(max_new_tokens):
            token = int(self._next_logits.argmax())
            new.append(token)
            if token == eos or step == max_new_tokens - 1:
                self._pending = token
                break
            self._decode(token)
        self.stats.decode_seconds += time.perf_counter() - start
        self.stats.decode_tokens += len(new)
        self._track_peak()
        return new

    def _decode(self, token: int) -> None:
        ids = torch.tensor([[token]], device=self.model.device)
        out = self.model(input_ids=ids, logits_to_keep=1, **{self._cache_keyword: self.cache})
        self._next_logits = out.logits[0, -1]

    def _flush_pending(self) -> None:
        if self._pending is not None:
            token, self._pending = self._pending, None
            self._decode(token)

    def close(self) -> None:
        """Detach the stream's cache from the model: the model is then as it was."""
        self.cache.detach()

    def __enter__(self) -> BoundedStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ask(self, question: str, max_new_tokens: int = 32) -> str:
        """Feed ``question`` and answer it greedily.

        Args:
            question: the text that closes the prompt.
            max_new_tokens: the most tokens to decode, >= 1.

        Returns:
            The decoded answer, special tokens dropped and whitespace stripped.

        Raises:
            BMRTError: a stream without a tokenizer.
        """
        if self.tokenizer is None:
            raise BMRTError("ask() needs a tokenizer")
        new = self.generate(question, max_new_tokens)
        return self.tokenizer.decode(new, skip_special_tokens=True).strip()

    def _track_peak(self) -> None:
        self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, self.cache.peak_kv_bytes())
