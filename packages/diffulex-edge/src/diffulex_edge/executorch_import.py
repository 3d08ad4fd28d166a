"""Import ExecuTorch on first use: a clear error when it is not installed, and without the
log lines its import makes its dependencies print that say nothing about this package.

``executorch.runtime`` imports ``executorch.exir``, which imports ``torchao``. On a
CPU-only torch, torchao logs one "Failed to load" warning for each of its CUDA kernel
libraries (which cannot load there and are never used here), and registers an enum in a
way torch's pytree logs as deprecated. Those three records are dropped at their loggers,
for the duration of the import only; every other record passes.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from diffulex_edge.errors import DiffulexEdgeError

INSTALL_HINT = "pip install 'diffulex-edge[executorch]'"


class _DropDependencyNoise(logging.Filter):
    def __init__(self, cuda_built: bool) -> None:
        super().__init__()
        self.cuda_built = cuda_built

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            # A CUDA kernel library that a CPU-only torch cannot load.
            return self.cuda_built or not (
                message.startswith("Failed to load") and "/torchao/_C" in message
            )
        return "register_constant() on Enum subclasses is deprecated" not in message


@contextmanager
def _quiet():
    import torch

    noise = _DropDependencyNoise(cuda_built=torch.version.cuda is not None)
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    for logger in loggers:
        logger.addFilter(noise)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(noise)


def _missing(what: str, err: ImportError) -> DiffulexEdgeError:
    return DiffulexEdgeError(f"{what} needs ExecuTorch ({err}): {INSTALL_HINT}")


def runtime():
    """``executorch.runtime.Runtime`` (running ``.pte`` programs)."""
    try:
        with _quiet():
            from executorch.runtime import Runtime
    except ImportError as err:
        raise _missing("running a .pte", err) from err
    return Runtime


def lowering():
    """``(to_edge_transform_and_lower, XnnpackPartitioner)`` (exporting a ``.pte``)."""
    try:
        with _quiet():
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
                XnnpackPartitioner,
            )
            from executorch.exir import to_edge_transform_and_lower
    except ImportError as err:
        raise _missing("exporting a .pte", err) from err
    return to_edge_transform_and_lower, XnnpackPartitioner


def llm_custom_ops() -> None:
    """Register ExecuTorch's LLM custom ops (``llama::update_cache``, ``llama::custom_sdpa``)
    with torch (eager, export) and with the runtime (their kernels), once per process: the
    ``static_kv`` variant's graph is built from them."""
    try:
        with _quiet():
            from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
    except ImportError as err:
        raise _missing("the static_kv variant (ExecuTorch's LLM custom ops)", err) from err
    except (AssertionError, OSError) as err:  # the package's own check: no or two libraries
        raise DiffulexEdgeError(
            f"ExecuTorch's LLM custom-ops library could not be loaded ({err!r}): the "
            "static_kv variant needs an executorch build that ships it (the PyPI wheels do)"
        ) from err
