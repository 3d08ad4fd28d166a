"""Block-diffusion generation following the SDAR reference decoder.

The sequence is cut into blocks of ``block_size`` from position 0. Whole prompt blocks are
prefilled; the block holding the prompt's tail (or the first fresh block) starts with mask
tokens in every position after the prompt. Each step scores the block (logits at position i
predict token i: no shift), samples a token per position, and the remasking strategy picks
which masked positions to fill. A block with no mask left is committed with one extra
forward; decoding stops after the block that produced EOS or reaches max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffulex_edge.backends import Backend
from diffulex_edge.remasking import REMASKING, make_remasking, num_transfer_tokens
from diffulex_edge.sampling import SamplingConfig, sample_tokens


@dataclass
class GenerationConfig:
    """How :func:`generate`, :func:`generate_autoregressive` and ``PteEngine.generate`` decode.

    Args:
        max_new_tokens: the most tokens to generate (>= 1).
        steps: denoising steps per block at most (default: block_size, one token a step).
            Block diffusion only.
        remasking: which masked positions a step fills, a name in
            :data:`diffulex_edge.remasking.REMASKING` (``sequential``,
            ``low_confidence_static``, ``low_confidence_dynamic``). Block diffusion only.
        threshold: the confidence bar of ``low_confidence_dynamic``, in [0, 1].
        sampling: temperature, top-k, top-p and seed
            (:class:`diffulex_edge.sampling.SamplingConfig`; default greedy).
        stop_on_eos: stop after the block (or token) that produced EOS.

    Raises:
        ValueError: ``max_new_tokens`` not an int >= 1, an unknown ``remasking``, or
            ``threshold`` outside [0, 1].
    """

    max_new_tokens: int = 32
    steps: int | None = None
    remasking: str = "low_confidence_dynamic"
    threshold: float = 0.9
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.remasking not in REMASKING:
            raise ValueError(
                f"remasking must be one of {sorted(REMASKING)}, got {self.remasking!r}"
            )
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")


@dataclass
class GenerationResult:
    """``tokens``: the new tokens, cut at max_new_tokens and before the first EOS."""

    tokens: list[int]
    denoise_forwards: int
    commit_forwards: int
    decoded_tokens: int  # masked positions filled (the numerator of tokens per forward)
    stopped_on_eos: bool

    @property
    def tokens_per_forward(self) -> float:
        """Tokens per denoising forward, the SDAR/dLLM measure of parallel decoding."""
        return self.decoded_tokens / max(self.denoise_forwards, 1)

    @property
    def tokens_per_forward_with_commits(self) -> float:
        return self.decoded_tokens / max(self.denoise_forwards + self.commit_forwards, 1)


def check_token_ids(prompt_ids: list[int] | torch.Tensor, vocab_size: int) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` before they index an embedding (an
    out-of-range index is an IndexError in eager PyTorch, and undefined inside a .pte)."""
    prompt = torch.as_tensor(prompt_ids).flatten()
    if prompt.is_floating_point() or prompt.dtype == torch.bool:
        raise ValueError(f"prompt_ids must be integer token ids, got dtype {prompt.dtype}")
    bad = prompt[(prompt < 0) | (prompt >= vocab_size)]
    if bad.numel():
        raise ValueError(
            f"prompt_ids holds {bad[:5].tolist()}, outside the model's vocabulary [0, {vocab_size})"
        )


def generate(
    backend: Backend,
    prompt_ids: list[int] | torch.Tensor,
    config: GenerationConfig,
    mask_token_id: int,
    eos_token_id: int | None = None,
) -> GenerationResult:
    """Decode after ``prompt_ids`` with ``backend`` by block diffusion; see the module
    docstring.

    Args:
        backend: the forward to drive, e.g. :class:`~diffulex_edge.backends.EagerDynamic` on
            a model; its ``block_size`` is the block size. Its cache is reset first.
        prompt_ids: the prompt's token ids, a list of ints or an integer tensor.
        config: how many tokens, the steps per block, the remasking and the sampling.
        mask_token_id: the model's mask token (``model.config.mask_token_id``).
        eos_token_id: the model's EOS token, or None to decode ``max_new_tokens``.

    Returns:
        :class:`GenerationResult`: the new tokens (cut before the first EOS) and the
        forwards they took.

    Raises:
        ValueError: an empty prompt, the mask token in the prompt, or a prompt plus
            ``max_new_tokens`` (in whole blocks) longer than ``backend.max_seq``.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    P, bs = prompt.numel(), backend.block_size
    if P == 0:
        raise ValueError("prompt_ids is empty; block diffusion needs at least one prompt token")
    steps = bs if config.steps is None else config.steps
    schedule = num_transfer_tokens(bs, steps)
    total = -(-(P + config.max_new_tokens) // bs) * bs
    if total > backend.max_seq:
        raise ValueError(
            f"prompt of {P} tokens + max_new_tokens {config.max_new_tokens} needs {total} "
            f"cache slots (whole blocks of {bs}), more than max_seq {backend.max_seq}"
        )
    if (prompt == mask_token_id).any():
        raise ValueError(f"prompt_ids contains the mask token id {mask_token_id}")
    remasking = make_remasking(config.remasking, config.threshold)
    generator = None
    if config.sampling.seed is not None:
        generator = torch.Generator().manual_seed(config.sampling.seed)

    x = torch.full((1, total), mask_token_id, dtype=torch.long)
    x[0, :P] = prompt
    backend.reset()
    prefill_blocks = P // bs
    backend.prefill(x[:, : prefill_blocks * bs])
    denoise = commits = decoded = 0
    stopped = False
    for b in range(prefill_blocks, total // bs):
        cur = x[:, b * bs : (b + 1) * bs].clone()
        step = 0
        while True:
            mask_index = cur[0] == mask_token_id
            if not mask_index.any():
                backend.commit(cur)
                commits += 1
                break
            logits = backend.denoise(cur)
            denoise += 1
            x0, conf = sample_tokens(logits[0], config.sampling, generator)
            transfer = remasking.select(mask_index, conf, schedule[min(step, steps - 1)])
            cur[0, transfer] = x0[transfer]
            decoded += int(transfer.sum())
            step += 1
        x[:, b * bs : (b + 1) * bs] = cur
        new = x[0, P:]
        if config.stop_on_eos and eos_token_id is not None and (new == eos_token_id).any():
            stopped = True
            break
    tokens = x[0, P : P + config.max_new_tokens].tolist()
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id)]
    return GenerationResult(tokens, denoise, commits, decoded, stopped)


def generate_autoregressive(
    backend: Backend,
    prompt_ids: list[int] | torch.Tensor,
    config: GenerationConfig,
    eos_token_id: int | None = None,
) -> GenerationResult:
    """Next-token decoding of an autoregressive model (Llama, Qwen2/3): block diffusion with
    block size 1, where the forward that commits token t predicts token t + 1, so every new
    token costs one forward. The prompt enters by :meth:`Backend.prefill_causal` (chunked
    where the backend has a prefill path). ``config.remasking``/``threshold``/``steps`` do
    not apply; ``denoise_forwards`` counts the decode forwards.

    Args:
        backend: the forward to drive, with block size 1 (e.g.
            ``EagerDynamic(model, 1)``). Its cache is reset first.
        prompt_ids: the prompt's token ids, a list of ints or an integer tensor.
        config: how many tokens and the sampling.
        eos_token_id: the model's EOS token, or None to decode ``max_new_tokens``.

    Returns:
        :class:`GenerationResult`: the new tokens (without the EOS) and the forwards they
        took.

    Raises:
        ValueError: an empty prompt, a backend whose block size is not 1, or a prompt plus
            ``max_new_tokens`` longer than ``backend.max_seq`` allows.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    P = prompt.numel()
    if P == 0:
        raise ValueError("prompt_ids is empty; autoregressive decoding needs a prompt token")
    if backend.block_size != 1:
        raise ValueError(
            f"autoregressive decoding needs block_size 1, the backend has {backend.block_size}"
        )
    # The last new token is sampled but never committed: it needs no cache slot.
    if P + config.max_new_tokens - 1 > backend.max_seq:
        raise ValueError(
            f"prompt of {P} tokens + max_new_tokens {config.max_new_tokens} needs "
            f"{P + config.max_new_tokens - 1} cache slots, more than max_seq {backend.max_seq}"
        )
    generator = None
    if config.sampling.seed is not None:
        generator = torch.Generator().manual_seed(config.sampling.seed)
    backend.reset()
    logits = backend.prefill_causal(prompt[None])  # (1, vocab)
    tokens: list[int] = []
    forwards = 0
    stopped = False
    while True:
        token, _ = sample_tokens(logits, config.sampling, generator)
        token = int(token[0])
        if config.stop_on_eos and eos_token_id is not None and token == eos_token_id:
            stopped = True
            break
        tokens.append(token)
        if len(tokens) == config.max_new_tokens:
            break
        logits = backend.commit(torch.tensor([[token]]))[:, -1]
        forwards += 1
    return GenerationResult(tokens, forwards, 0, len(tokens), stopped)
