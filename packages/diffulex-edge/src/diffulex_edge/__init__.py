"""Block-diffusion LM inference with a static KV cache, exported to ExecuTorch."""

from diffulex_edge.__about__ import __version__

__all__ = ["__version__"]
