"""#56: what a user calls is documented as transformers and safetensors document it. Every
function in a package's ``__all__`` that takes arguments, and every public method of a class
there, has an ``Args:`` section; every class there (errors aside) says what it takes in an
``Args:`` or ``Attributes:`` section of its own docstring or its ``__init__``'s."""

from __future__ import annotations

import importlib
import inspect

import pytest

PACKAGES = ["bmrt_kv", "diffulex_edge", "moe_expert_cache", "paired_cache", "zstd_linear"]


def _takes_arguments(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(p not in ("self", "cls") for p in params)


def _doc(cls, attr: str) -> str:
    """The method's docstring, or the one it inherits (what ``help()`` shows)."""
    return inspect.getdoc(getattr(cls, attr)) or ""


def undocumented(package: str) -> list[str]:
    module = importlib.import_module(package)
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            if _takes_arguments(obj) and "Args:" not in (inspect.getdoc(obj) or ""):
                missing.append(name)
        elif inspect.isclass(obj) and not issubclass(obj, BaseException):
            doc = (inspect.getdoc(obj) or "") + (inspect.getdoc(obj.__init__) or "")
            if _takes_arguments(obj) and "Args:" not in doc and "Attributes:" not in doc:
                missing.append(name)
            for attr, fn in vars(obj).items():
                public = inspect.isfunction(fn) and not attr.startswith("_")
                if public and _takes_arguments(fn) and "Args:" not in _doc(obj, attr):
                    missing.append(f"{name}.{attr}")
    return missing


@pytest.mark.parametrize("package", PACKAGES)
def test_public_api_has_args_sections(package):
    assert undocumented(package) == []
