"""The package's one error type for damaged or invalid input."""

from __future__ import annotations


class CompressedFileError(ValueError):
    """A .zlin file (or a compressed weight) is truncated, corrupted, of another version,
    malformed, or does not fit the model it is loaded into. The message names the file,
    the layer or field, and what was expected. A ValueError, so code that catches
    ValueError keeps working."""
