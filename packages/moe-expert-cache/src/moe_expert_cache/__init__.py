"""Predictive expert cache for Mixture-of-Experts models on MLX (mlx-lm)."""

from moe_expert_cache.__about__ import __version__

__all__ = ["__version__"]
