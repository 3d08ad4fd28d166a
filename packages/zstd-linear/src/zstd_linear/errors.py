"""The package's error types: one base for bad input, one subclass for damaged files."""

from __future__ import annotations


class ZstdLinearError(ValueError):
    """A bad argument to zstd-linear (a policy name or option, a thread count, a glob that
    matches no nn.Linear, a model that is or is not compressed, an unsupported dtype),
    raised before anything changes. The message names the argument and what was
    expected. A ValueError, so code that catches ValueError keeps working; damaged or
    invalid files raise its subclass CompressedFileError."""


class CompressedFileError(ZstdLinearError):
    """A .zlin file (or a compressed weight) is truncated, corrupted, of another version,
    malformed, or does not fit the model it is loaded into. The message names the file,
    the layer or field, and what was expected. A ZstdLinearError (and so a ValueError)."""
