"""The selector registry: names the CLI, the config and the benchmarks enumerate."""

from __future__ import annotations

import inspect

from bmrt_kv.errors import BMRTError, check_choice
from bmrt_kv.selectors.base import Pool, Selector
from bmrt_kv.selectors.exact import ExactSelector
from bmrt_kv.selectors.h2o import H2OSelector
from bmrt_kv.selectors.hybrid import HybridSelector
from bmrt_kv.selectors.keydiff import KeyDiffSelector
from bmrt_kv.selectors.lsh import LSHSelector
from bmrt_kv.selectors.magicpig import MagicPIGSelector
from bmrt_kv.selectors.snapkv import SnapKVSelector
from bmrt_kv.selectors.streaming import StreamingSelector
from bmrt_kv.selectors.tiebreak import TIE_BREAKERS

SELECTORS: dict[str, type[Selector]] = {
    "exact": ExactSelector,
    "lsh": LSHSelector,
    "magicpig": MagicPIGSelector,
    "hybrid": HybridSelector,
    "streaming": StreamingSelector,
    "h2o": H2OSelector,
    "snapkv": SnapKVSelector,
    "keydiff": KeyDiffSelector,
}


def make_selector(name: str, options: dict | None = None, seed: int = 0) -> Selector:
    """Instantiate the selector registered as ``name`` with keyword ``options``.

    Raises :class:`~bmrt_kv.BMRTError` naming the selector and the option for an unknown
    option or a bad value.
    """
    check_choice("selector", name, SELECTORS)
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise BMRTError(f"selector_options of {name!r} must be a dict, got {options!r}")
    known = set(inspect.signature(SELECTORS[name]).parameters) - {"seed"}
    for key in options:
        if not isinstance(key, str) or key not in known:
            # seed is BMRTConfig.seed's (one generator per layer), never an option.
            raise BMRTError(
                f"selector_options of {name!r}: unknown option {key!r}; "
                f"{name!r} takes {sorted(known) or 'no options'}"
            )
    return SELECTORS[name](seed=seed, **options)


__all__ = ["SELECTORS", "TIE_BREAKERS", "BMRTError", "Pool", "Selector", "make_selector"]
