"""Bounded-memory recursive KV cache for Hugging Face transformers models."""

from bmrt_kv.__about__ import __version__
from bmrt_kv.cache import BMRTCache, attached
from bmrt_kv.config import BMRTConfig
from bmrt_kv.errors import BMRTError
from bmrt_kv.hooks import detach
from bmrt_kv.selectors import SELECTORS, TIE_BREAKERS, Pool, Selector, make_selector
from bmrt_kv.stream import BoundedStream

__all__ = [
    "SELECTORS",
    "TIE_BREAKERS",
    "BMRTCache",
    "BMRTConfig",
    "BMRTError",
    "BoundedStream",
    "Pool",
    "Selector",
    "__version__",
    "attached",
    "detach",
    "make_selector",
]
