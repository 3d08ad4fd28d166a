"""The package's one error type for damaged or invalid input."""

from __future__ import annotations


class ExpertCacheError(ValueError):
    """A file, config or argument that this package refuses: a damaged or foreign shard,
    ``config.json``, cache state or router trace, or an out-of-range setting.

    The message names the file (or parameter), the field or layer, and what was expected.
    Subclasses ``ValueError``, so code catching ``ValueError`` keeps working.
    """


class MissingShardError(ExpertCacheError, FileNotFoundError):
    """A shard named by the model's index is not in the model directory (also a
    ``FileNotFoundError``, as before 0.2.0)."""
