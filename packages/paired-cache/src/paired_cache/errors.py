"""paired-cache's error type."""

from __future__ import annotations


class PairedCacheError(ValueError):
    """A bad argument (weights, capacity, config, mask): the message names it and what was
    expected. Raised before the C core is touched, so the cache is left as it was.

    A ValueError, so callers that catch ValueError keep working.
    """
