"""The selectors, registered by name (bmrt_kv.selectors.registry): the names the CLI, the
config and the benchmarks enumerate."""

from __future__ import annotations

from bmrt_kv.errors import BMRTError
from bmrt_kv.selectors.base import Pool, Selector
from bmrt_kv.selectors.exact import ExactSelector
from bmrt_kv.selectors.h2o import H2OSelector
from bmrt_kv.selectors.hybrid import HybridSelector
from bmrt_kv.selectors.keydiff import KeyDiffSelector
from bmrt_kv.selectors.lsh import LSHSelector
from bmrt_kv.selectors.magicpig import MagicPIGSelector
from bmrt_kv.selectors.registry import SELECTORS, make_selector
from bmrt_kv.selectors.snapkv import SnapKVSelector
from bmrt_kv.selectors.streaming import StreamingSelector
from bmrt_kv.selectors.tiebreak import TIE_BREAKERS

SELECTORS.update(
    {
        "exact": ExactSelector,
        "lsh": LSHSelector,
        "magicpig": MagicPIGSelector,
        "hybrid": HybridSelector,
        "streaming": StreamingSelector,
        "h2o": H2OSelector,
        "snapkv": SnapKVSelector,
        "keydiff": KeyDiffSelector,
    }
)


__all__ = ["SELECTORS", "TIE_BREAKERS", "BMRTError", "Pool", "Selector", "make_selector"]
