"""Paired-replacement weight cache for contextually sparse MLPs (C core through cffi)."""

from paired_cache.__about__ import __version__

__all__ = ["__version__"]
