"""Caching policies by name: none, per_pass, per_pass_prefetch, budget, resident."""

from __future__ import annotations

from zstd_linear.errors import ZstdLinearError
from zstd_linear.policies.base import BackingStore, CachePolicy
from zstd_linear.policies.budget import Budget
from zstd_linear.policies.none import NoCache
from zstd_linear.policies.per_pass import PerPass
from zstd_linear.policies.prefetch import PerPassPrefetch
from zstd_linear.policies.resident import Resident

POLICIES: dict[str, type[CachePolicy]] = {
    cls.name: cls for cls in (NoCache, PerPass, PerPassPrefetch, Budget, Resident)
}


def check_policy(name) -> None:
    """ZstdLinearError unless ``name`` is a ``POLICIES`` name."""
    if not isinstance(name, str) or name not in POLICIES:
        raise ZstdLinearError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")


def make_policy(name: str, store: BackingStore, **options) -> CachePolicy:
    """The policy ``name`` over ``store``; ZstdLinearError for an unknown name or option."""
    check_policy(name)
    try:
        return POLICIES[name](store, **options)
    except TypeError as exc:
        raise ZstdLinearError(f"bad options {sorted(options)} for policy {name!r}: {exc}") from None


__all__ = [
    "POLICIES",
    "BackingStore",
    "Budget",
    "CachePolicy",
    "NoCache",
    "PerPass",
    "PerPassPrefetch",
    "Resident",
    "check_policy",
    "make_policy",
]
