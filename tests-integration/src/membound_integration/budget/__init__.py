"""The budget runner: a command, or a demo row, in a fresh process under a hard memory
limit (cgroups), with an optional storage read-bandwidth limit, reporting anonymous and
file-backed memory apart, bytes read from storage, and OOM kills; and a bisection for the
smallest limit that still gives the right answer."""

from membound_integration.budget.cgroup import Cgroup, CgroupUnavailable, drop_page_cache
from membound_integration.budget.profiles import PROFILES, Profile
from membound_integration.budget.runner import (
    Bisection,
    RunResult,
    bisect_min_limit,
    run_limited,
)

__all__ = [
    "PROFILES",
    "Bisection",
    "Cgroup",
    "CgroupUnavailable",
    "Profile",
    "RunResult",
    "bisect_min_limit",
    "drop_page_cache",
    "run_limited",
]
