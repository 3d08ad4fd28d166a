"""Bounded-memory recursive KV cache for Hugging Face transformers models."""

from bmrt_kv.__about__ import __version__

__all__ = ["__version__"]
