"""Tuning knobs of a PairedCache: a validated dataclass, defaults from the environment."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from paired_cache.errors import PairedCacheError

ENV_TAU = "PAIRED_CACHE_HYBRID_TAU"
ENV_GRAIN = "PAIRED_CACHE_GRAIN"
ENV_PAR_THRESHOLD = "PAIRED_CACHE_PAR_THRESHOLD"
# Names read before 0.5.0: refused with the new name, so that a setting is never dropped
# silently.
OLD_ENV = {
    "WEIGHT_CACHE_HYBRID_TAU_FRAC": ENV_TAU,
    "WEIGHT_CACHE_GRAIN": ENV_GRAIN,
    "WEIGHT_CACHE_PAR_THRESHOLD": ENV_PAR_THRESHOLD,
}
MAX_THREADS = 64  # the C core's limit (PC_MAX_THREADS)
# The C core holds grain and par_threshold in int64_t; row counts never pass 2**31 - 1.
MAX_ROWS = 2**31 - 1
MAX_INT64 = 2**63 - 1
# Measured break-even of paired vs rebuild for same-size masks (benchmarks/update_bench.py).
DEFAULT_HYBRID_TAU = 1.8


def _env_number(name: str, default, kind):
    for old, new in OLD_ENV.items():
        if new == name and os.environ.get(old):
            raise PairedCacheError(
                f"environment variable {old} is no longer read; set {new} instead"
            )
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise PairedCacheError(
            f"environment variable {name}={raw!r} is not a valid {kind.__name__}"
        ) from None


def _default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_THREADS))


@dataclass
class PairedCacheConfig:
    """How a PairedCache updates.

    Every field is checked at construction (a bool is not an int here, NaN is not a number)
    and again by PairedCache, before the C core sees it; a bad value raises PairedCacheError
    naming the field and its range. Each defaults to its environment variable
    (PAIRED_CACHE_HYBRID_TAU = 1.8, PAIRED_CACHE_GRAIN = 64, PAIRED_CACHE_PAR_THRESHOLD = 64)
    or the usable cores.

    Attributes:
        hybrid_tau: Rebuild by gather when k = |added| + |removed| > hybrid_tau * m, where m
            is the mean of the active rows before and after the update (>= 0; 0 always
            rebuilds, >= 2 never does, since k <= 2m). The default 1.8 is measured, not the
            design's 0.5: a paired update copies max(|A|, |R|) rows (k / 2 when the mask
            keeps its size), a rebuild all m, in ascending row order and a little faster
            per row, so rebuilding only pays once nearly every row changes.
        grain: Rows per parallel chunk, in [1, 2**31 - 1].
        par_threshold: Updates copying fewer rows stay on the calling thread, in
            [0, 2**63 - 1].
        num_threads: Threads for row copies (1..64).
    """

    hybrid_tau: float = field(
        default_factory=lambda: _env_number(ENV_TAU, DEFAULT_HYBRID_TAU, float)
    )
    grain: int = field(default_factory=lambda: _env_number(ENV_GRAIN, 64, int))
    par_threshold: int = field(default_factory=lambda: _env_number(ENV_PAR_THRESHOLD, 64, int))
    num_threads: int = field(default_factory=_default_threads)

    def __post_init__(self) -> None:
        tau = self.hybrid_tau
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau >= 0:
            raise PairedCacheError(
                f"hybrid_tau must be a number >= 0 (inf: never rebuild), got {tau!r}"
            )
        if isinstance(tau, int) and tau > sys.float_info.max:  # would overflow float()
            raise PairedCacheError(
                f"hybrid_tau={tau} does not fit a double; use math.inf to never rebuild"
            )
        self.hybrid_tau = float(tau)
        for name, low, high in (
            ("grain", 1, MAX_ROWS),
            ("par_threshold", 0, MAX_INT64),
            ("num_threads", 1, MAX_THREADS),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PairedCacheError(f"{name} must be an int, got {value!r}")
            if not low <= value <= high:
                raise PairedCacheError(f"{name} must be in [{low}, {high}], got {value}")
