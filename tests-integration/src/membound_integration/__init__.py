"""membound's integration package: the demo and the cross-package tests."""

from membound_integration.__about__ import __version__

__all__ = ["__version__"]
