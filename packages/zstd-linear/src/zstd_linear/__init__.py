"""Lossless zstd-compressed Linear layers with per-forward-pass caching and prefetch."""

from zstd_linear.__about__ import __version__

__all__ = ["__version__"]
