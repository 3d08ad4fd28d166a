"""The selector registry: names the CLI, the config and the benchmarks enumerate."""

from __future__ import annotations

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
    """Instantiate the selector registered as ``name`` with keyword ``options``."""
    if name not in SELECTORS:
        raise ValueError(f"selector must be one of {sorted(SELECTORS)}, got {name!r}")
    try:
        return SELECTORS[name](seed=seed, **(options or {}))
    except TypeError as err:
        raise ValueError(f"bad selector_options for {name!r}: {err}") from err


__all__ = ["SELECTORS", "TIE_BREAKERS", "Pool", "Selector", "make_selector"]
