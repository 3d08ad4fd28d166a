"""Import ExecuTorch on first use: a clear error when it is not installed, and without the
log lines its import makes its dependencies print that say nothing about this package.

Exporting imports ``executorch.exir``, which imports ``torchao``. On a CPU-only torch,
torchao logs one "Failed to load" warning for each of its CUDA kernel libraries (which
cannot load there and are never used here), and registers an enum in a way torch's pytree
logs as deprecated. Those three records are dropped at their loggers, for the duration of
the import only; every other record passes.

Running a program does not need the exporter. ``executorch.runtime`` imports it anyway
(through ``executorch.extension.pybindings.portable_lib``, for a warning class): 2,900
modules, about 3 s and 130 MiB of anonymous memory, as much as torch itself. So
:func:`runtime` opens the compiled runtime module, ``executorch.extension.pybindings._C``,
directly (after torch, whose libraries it links) and wraps it in the same
``load_program`` / ``method_names`` / ``load_method`` / ``execute`` / ``metadata`` calls as
``executorch.runtime``; where that module is missing or has other entry points, it falls
back to ``executorch.runtime`` itself. For the same reason :func:`llm_custom_kernels` loads
the LLM custom-ops kernel library alone, without the Python module that registers their
export-time implementations (it imports ``torch._inductor``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

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


class Method:
    """A loaded method: ``execute(inputs)`` and ``metadata``, as ``executorch.runtime``'s."""

    def __init__(self, method) -> None:
        self._method = method

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        return self._method(inputs)

    @property
    def metadata(self):
        return self._method.method_meta()


class Program:
    """A loaded program: ``method_names`` and ``load_method(name)`` (each method loaded
    once and kept), as ``executorch.runtime``'s."""

    def __init__(self, program) -> None:
        self._program = program
        self._methods: dict[str, Method | None] = {
            program.get_method_name(i): None for i in range(program.num_methods())
        }

    @property
    def method_names(self) -> set[str]:
        return set(self._methods)

    def load_method(self, name: str) -> Method:
        method = self._methods[name]
        if method is None:
            method = self._methods[name] = Method(self._program.load_method(name))
        return method


class _LeanRuntime:
    """ExecuTorch's compiled runtime module, without the exporter ``executorch.runtime``
    imports."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module

    def load_program(self, path: str) -> Program:
        """The program at ``path``, memory-mapped by ExecuTorch, verified for internal
        consistency (``executorch.runtime``'s default)."""
        module = self._module
        return Program(
            module._load_program(
                str(path),
                enable_etdump=False,
                debug_buffer_size=0,
                program_verification=module.Verification.InternalConsistency,
                data_path=None,
            )
        )


_ENTRY_POINTS = ("_load_program", "Verification")


@cache
def runtime():
    """ExecuTorch's runtime: an object whose ``load_program(path)`` returns a program (see
    the module docstring). Loads the runtime's libraries, so its backends and kernels are
    registered once this returns."""
    try:
        import torch  # noqa: F401  (the runtime module links torch's libraries)

        module = importlib.import_module("executorch.extension.pybindings._C")
    except ImportError:
        module = None
    if module is not None and all(hasattr(module, name) for name in _ENTRY_POINTS):
        return _LeanRuntime(module)
    try:
        with _quiet():
            from executorch.runtime import Runtime
    except ImportError as err:
        raise _missing("running a .pte", err) from err
    return Runtime.get()


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


_CUSTOM_OPS_LIBRARY = "extension/llm/custom_ops/*custom_ops_aot_lib.*"


@cache
def llm_custom_kernels() -> None:
    """Load the kernels of ExecuTorch's LLM custom ops (``llama::update_cache``,
    ``llama::custom_sdpa``) into the runtime, once per process: what running a
    ``static_kv`` program needs. Exporting one needs :func:`llm_custom_ops`."""
    import torch

    runtime()  # the runtime the kernels register with
    if _llama_ops_registered(torch):
        return
    try:
        import executorch
    except ImportError as err:
        raise _missing("running a static_kv program", err) from err
    libraries = sorted({p for d in executorch.__path__ for p in Path(d).glob(_CUSTOM_OPS_LIBRARY)})
    if len(libraries) != 1:
        raise DiffulexEdgeError(
            f"ExecuTorch's LLM custom-ops library: found {[str(p) for p in libraries]} under "
            f"{list(executorch.__path__)}, expected one; the static_kv variant needs an "
            "executorch build that ships it (the PyPI wheels do)"
        )
    try:
        torch.ops.load_library(str(libraries[0]))
    except OSError as err:
        raise DiffulexEdgeError(
            f"ExecuTorch's LLM custom-ops library {libraries[0]} could not be loaded ({err})"
        ) from err


def _llama_ops_registered(torch) -> bool:
    try:
        return torch.ops.llama.custom_sdpa.default is not None
    except (AttributeError, RuntimeError):
        return False


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
