"""The one error type of diffulex-edge."""

from __future__ import annotations


class DiffulexEdgeError(ValueError):
    """A damaged or invalid input: a checkpoint, a ``.pte`` program or its integrity record,
    or a config value. The message names the file (where there is one), the field, tensor or
    layer, and what was expected. Subclasses ``ValueError``, so ``except ValueError`` still
    catches it."""
