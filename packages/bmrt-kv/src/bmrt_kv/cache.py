"""The bounded-memory recursive KV cache, a transformers ``Cache``."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import fields, replace

import torch
from torch import nn
from transformers.cache_utils import Cache

from bmrt_kv.config import BMRTConfig
from bmrt_kv.errors import BMRTError
from bmrt_kv.hooks import Attachment
from bmrt_kv.layer import BMRTLayer
from bmrt_kv.selectors import make_selector
from bmrt_kv.support import plan_layers, rotary_inv_freq
from bmrt_kv.window import SlidingWindowLayer


class BMRTCache(Cache):
    """A KV cache that holds at most ``config.budget`` tokens per layer, compressing
    recursively block by block: State_t = Compress(State_{t-1} U Block_t).

    Use it like any transformers cache::

        with BMRTCache(model, BMRTConfig(budget=512, block_size=256)) as cache:
            model.generate(ids, past_key_values=cache, prefill_chunk_size=256)

    Constructing it installs forward hooks on ``model`` (see :mod:`bmrt_kv.hooks`) that
    hand each layer its block's queries after attention; they act only on forwards that
    use this cache. They are removed, leaving the model exactly as it was, when the
    ``with`` block ends, on :meth:`detach`, or when the cache is garbage-collected.
    Full-attention layers hold at most ``budget`` tokens between forwards; the
    sliding-window layers of a hybrid model (Gemma 2, Gemma 3) keep transformers' own
    window (``sliding_window - 1`` tokens between forwards). Inputs must be unpadded (one
    sequence, or equal-length rows): the first forward whose attention mask has a zero
    raises :class:`BMRTError` before any of its layers runs. Greedy and sampled decoding work; beam search
    does not (it reorders rows of a cache whose rows keep different tokens) and raises
    :class:`BMRTError`.

    ``scoring="query_aware"`` needs the question, which ``generate`` never passes to a
    cache: use :class:`~bmrt_kv.stream.BoundedStream` with ``question=``.

    Args:
        model: a transformers causal LM whose layers are full or sliding-window attention
            (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite,
            SmolLM3; see the README's support table).
        config: the :class:`BMRTConfig` (None: the defaults).
        **overrides: fields that replace the config's (``budget=256``).

    Raises:
        BMRTError: a bad config or an unknown override, or a model it cannot cache (naming
            its ``model_type`` and what is missing); nothing is attached then.
    """

    def __init__(self, model: nn.Module, config: BMRTConfig | None = None, **overrides):
        self._build(model, config, overrides, question_supplied=False)

    @classmethod
    def _with_question(cls, model: nn.Module, config: BMRTConfig) -> BMRTCache:
        """A cache whose caller passes the question's tokens itself, as the last tokens of
        a forward (``scoring_only_tokens``): query-aware scoring is allowed. For
        :class:`~bmrt_kv.stream.BoundedStream`; users pass ``question=`` to the stream."""
        cache = cls.__new__(cls)
        cache._build(model, config, {}, question_supplied=True)
        return cache

    def _build(
        self, model: nn.Module, config: BMRTConfig | None, overrides: dict, question_supplied: bool
    ) -> None:
        config = BMRTConfig() if config is None else config
        if not isinstance(config, BMRTConfig):
            raise BMRTError(f"config must be a BMRTConfig, got {type(config).__name__}")
        names = [f.name for f in fields(BMRTConfig)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise BMRTError(f"unknown BMRTConfig fields {unknown}; the fields are {names}")
        # replace() runs the checks again: a config changed since it was built (or an
        # override) is validated before any layer exists.
        config = replace(config, **overrides)
        if config.scoring == "query_aware" and not question_supplied:
            raise BMRTError(
                "scoring='query_aware' needs the question, which model.generate() never "
                "passes to a cache; use BoundedStream(model, tokenizer, config, "
                "question=...), or scoring='agnostic' with generate()"
            )
        plans = plan_layers(model)
        inv_freq = rotary_inv_freq(model) if config.positions == "rerotate" else None
        layers = [
            BMRTLayer(
                config,
                make_selector(config.selector, config.selector_options, config.seed * 100_003 + i),
                inv_freq if plan.rotary else None,
            )
            if plan.kind == "full"
            else SlidingWindowLayer(plan.window)
            for i, plan in enumerate(plans)
        ]
        super().__init__(layers=layers)
        self.config = config
        #: trailing tokens of the next forward that only score (query-aware mode).
        self.scoring_only_tokens = 0
        self._attachment = Attachment(model, self, plans)
        # The hooks hold this cache weakly, so it can be collected; its hooks go with it.
        weakref.finalize(self, self._attachment.remove)

    def detach(self) -> None:
        """Remove this cache's hooks from the model (idempotent); the cache then no longer
        compresses, so stop using it."""
        self._attachment.remove()

    @property
    def attached(self) -> bool:
        """True while this cache's hooks are on the model."""
        return self._attachment.attached

    def __enter__(self) -> BMRTCache:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Refuse beam search.

        Args:
            beam_idx: (b,) int64, the rows' new order.

        Raises:
            BMRTError: always; each row keeps its own tokens.
        """
        raise BMRTError(
            "BMRTCache does not support beam search (num_beams > 1): each row keeps its own "
            "tokens, so beams cannot be reordered; use greedy or sampled decoding"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refuse to expand the rows.

        Args:
            repeats: copies of each row asked for.

        Raises:
            BMRTError: always; pass one row per sequence from the start.
        """
        raise BMRTError(
            "BMRTCache cannot be expanded to more rows (beam search, num_return_sequences "
            "> 1); pass one row per sequence from the start"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refuse to select rows.

        Args:
            indices: (n,) int64, the rows asked for.

        Raises:
            BMRTError: always.
        """
        raise BMRTError("BMRTCache rows cannot be selected or reordered after prefill")

    def needs_queries(self, layer_idx: int) -> bool:
        """Whether :meth:`finish_layer` of layer ``layer_idx`` uses this forward's queries
        (:meth:`BMRTLayer.needs_queries`); where it does not, the attention hook skips
        rotating them.

        Args:
            layer_idx: the layer's index in the model.

        Returns:
            True where the layer's selector will score this forward's queries.
        """
        return self.layers[layer_idx].needs_queries(self.scoring_only_tokens)

    def finish_layer(
        self, layer_idx: int, queries: torch.Tensor | None, n_forward: int | None = None
    ) -> None:
        """Compress layer ``layer_idx``; called by the attention hook after its attention ran.

        Args:
            layer_idx: the layer's index in the model.
            queries: (b, H, T, hd) float, rotated queries of the forward's T tokens; None
                where :meth:`needs_queries` is False, with ``n_forward`` = T.
            n_forward: T, where ``queries`` is None.
        """
        self.layers[layer_idx].finish(queries, self.scoring_only_tokens, n_forward)

    @property
    def stored_tokens(self) -> list[int]:
        """Tokens each layer holds now (full-attention and sliding-window layers alike)."""
        return [layer.stored for layer in self.layers]

    @property
    def token_limits(self) -> list[int]:
        """The most tokens each layer holds between forwards: ``budget`` for a
        full-attention layer, ``sliding_window - 1`` for a sliding-window one."""
        return [
            layer.sliding_window - 1
            if isinstance(layer, SlidingWindowLayer)
            else self.config.budget
            for layer in self.layers
        ]

    def kv_bytes(self) -> int:
        """Bytes of keys and values held now.

        Returns:
            The sum over all layers, sliding-window ones included.
        """
        return sum(
            layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized
        )

    def peak_kv_bytes(self) -> int:
        """Bytes of keys and values at each layer's largest size (during a block).

        Returns:
            The sum over all layers, sliding-window ones included.
        """
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                b, h, _, hd = layer.keys.shape
                per_token = b * h * (hd + layer.values.shape[-1]) * layer.keys.element_size()
                total += layer.peak_tokens * per_token
        return total


@contextlib.contextmanager
def attached(model: nn.Module, config=None, **overrides):
    """``with bmrt_kv.attached(model, config) as cache:`` a :class:`~bmrt_kv.BMRTCache`
    whose hooks are removed when the block ends, error or not; the model is then exactly
    as it was.

    Args:
        model: a supported transformers causal LM.
        config: the :class:`BMRTConfig` (None: the defaults).
        **overrides: fields that replace the config's.

    Yields:
        The attached :class:`~bmrt_kv.BMRTCache`.

    Raises:
        BMRTError: as :class:`~bmrt_kv.BMRTCache`; nothing is attached then.
    """
    cache = BMRTCache(model, config, **overrides)
    try:
        yield cache
    finally:
        cache.detach()
