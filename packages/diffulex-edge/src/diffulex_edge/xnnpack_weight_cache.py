"""One packed copy of a program's weights for all its methods: XNNPACK's weight cache.

At load time each XNNPACK delegate packs its weights into the layout its kernels read, in
anonymous memory. A program with a ``forward`` and a ``prefill`` method has two delegates
over the same weights, so without help it holds two packed copies (SmolLM2 in fp32: 517 MiB
each). ExecuTorch's XNNPACK backend can instead pack each weight once into a cache that every
delegate shares: the partitioner stores each weight in the program's named data, keyed by
its SHA-256, and the cache keys the packed weights by those names, so the second method
finds the first one's. The cache is off unless the runtime was built with it or the
backend option ``weight_cache_enabled`` is set before a method is loaded.

ExecuTorch's Python runtime (1.5) has no call that sets a backend option, so this module
calls the runtime's own ``executorch::runtime::set_option(backend, Span<BackendOption>)``
and ``get_option`` in the already loaded ``libexecutorch.so`` through ctypes, with the
``BackendOption`` layout of ExecuTorch's ``runtime/backend/options.h``. Every write is
read back: the backend rewrites the value as a bool only if it knows the option and the
layout is the one declared here, so a runtime without the option, or with another layout,
is reported as unavailable instead of trusted.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

BACKEND = b"XnnpackBackend"
OPTION = b"weight_cache_enabled"
_LIBRARY = "libexecutorch.so"
# The Itanium-mangled names of executorch::runtime::set_option / get_option
# (const char* backend_name, Span<BackendOption> options) -> Error.
_SET = "_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_GET = "_ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_BOOL, _INT = 0, 1  # alternative indices of the option's std::variant<bool, int, char[256]>


class _BackendOption(ctypes.Structure):
    """``struct BackendOption { char key[64]; std::variant<bool, int,
    std::array<char, 256>> value; }``: libstdc++ lays the variant out as 256 bytes of
    storage (alignment 4) followed by a one-byte alternative index."""

    _fields_ = [
        ("key", ctypes.c_char * 64),
        ("storage", ctypes.c_ubyte * 256),
        ("index", ctypes.c_ubyte),
        ("_padding", ctypes.c_ubyte * 3),
    ]


class WeightCacheUnavailable(RuntimeError):
    """The loaded ExecuTorch runtime cannot switch XNNPACK's weight cache from Python."""


def _functions():
    """ExecuTorch's set_option and get_option, from the library its Python runtime loaded."""
    from diffulex_edge.executorch_import import runtime

    runtime()  # loads libexecutorch.so and registers the XNNPACK backend
    try:
        # RTLD_NOLOAD: the library already in the process (the one holding the backend
        # registry), never a second copy found elsewhere on the search path.
        lib = ctypes.CDLL(_LIBRARY, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        functions = lib[_SET], lib[_GET]
    except (OSError, AttributeError) as err:
        raise WeightCacheUnavailable(
            f"ExecuTorch's runtime does not export its backend options here ({err})"
        ) from err
    for function in functions:
        function.restype = ctypes.c_uint32  # executorch::runtime::Error, 0 is Ok
        function.argtypes = [ctypes.c_char_p, ctypes.POINTER(_BackendOption), ctypes.c_size_t]
    return functions


def _option(index: int, value: int):
    # Room for two: were the runtime's struct larger than declared, its write stays in
    # this buffer, and the read-back below fails instead of memory being overwritten.
    options = (_BackendOption * 2)()
    options[0].key = OPTION
    options[0].index = index
    options[0].storage[0] = value
    return options


def weight_cache_enabled() -> bool:
    """Whether XNNPACK delegates loaded now share packed weights (the process-wide option).

    Raises :class:`WeightCacheUnavailable` if the runtime has no such option or does not
    answer in the declared layout.
    """
    _, get = _functions()
    # Preset as an int with a value no bool has: only a backend that knows the option
    # rewrites it as a bool (0 or 1).
    options = _option(_INT, 0xAB)
    err = get(BACKEND, options, 1)
    if err != 0 or options[0].index != _BOOL or options[0].storage[0] not in (0, 1):
        raise WeightCacheUnavailable(
            f"ExecuTorch's {BACKEND.decode()} did not report {OPTION.decode()} (error "
            f"{err}, alternative {options[0].index}, byte {options[0].storage[0]}); this "
            "runtime has no such option or another BackendOption layout"
        )
    return bool(options[0].storage[0])


def set_weight_cache(enabled: bool) -> None:
    """Switch XNNPACK's weight cache for the delegates loaded from now on, in this process;
    read back, else :class:`WeightCacheUnavailable`."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    set_, _ = _functions()
    err = set_(BACKEND, _option(_BOOL, int(enabled)), 1)
    if err != 0 or weight_cache_enabled() != enabled:
        raise WeightCacheUnavailable(
            f"ExecuTorch's {BACKEND.decode()} did not take {OPTION.decode()}={enabled} "
            f"(error {err})"
        )


@contextmanager
def shared_packed_weights() -> Iterator[None]:
    """XNNPACK's weight cache on for the methods loaded inside the block, then the option
    back to what it was (the setting is process-wide: another thread loading a program at
    the same time gets it too). Raises :class:`WeightCacheUnavailable` on entry if the
    runtime cannot switch it."""
    before = weight_cache_enabled()
    set_weight_cache(True)
    try:
        yield
    finally:
        set_weight_cache(before)
