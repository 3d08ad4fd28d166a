"""Block-diffusion LM inference with a static KV cache, exported to ExecuTorch.

The top level holds what a user calls: the loaders, eager generation, the exporter, the
engine that runs a ``.pte``, the generation config and the error type. Building blocks stay
in their modules: the model and its config (:mod:`diffulex_edge.model`,
:mod:`diffulex_edge.config`), the backends (:mod:`diffulex_edge.backends`), the caches
(:mod:`diffulex_edge.kv_cache`), the masks (:mod:`diffulex_edge.masks`), sampling and
remasking (:mod:`diffulex_edge.sampling`, :mod:`diffulex_edge.remasking`), the export
variants and quantization (:mod:`diffulex_edge.export`). The toy sorting model, its task,
its training and the random test models are not in the wheel: they are in the repository's
``packages/diffulex-edge/benchmarks/`` (``sort_task.py``, ``train_sort.py``,
``checkpoints/sort8``, ``random_sdar.py``).
"""

from diffulex_edge.__about__ import __version__
from diffulex_edge.backends import EagerDynamic
from diffulex_edge.checkpoint import load_checkpoint, save_checkpoint
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.export import export_pte
from diffulex_edge.generate import GenerationConfig, generate, generate_autoregressive
from diffulex_edge.hf_import import from_hf_model, load_gguf
from diffulex_edge.runtime import PteEngine

__all__ = [
    "DiffulexEdgeError",
    "EagerDynamic",
    "GenerationConfig",
    "PteEngine",
    "__version__",
    "export_pte",
    "from_hf_model",
    "generate",
    "generate_autoregressive",
    "load_checkpoint",
    "load_gguf",
    "save_checkpoint",
]
