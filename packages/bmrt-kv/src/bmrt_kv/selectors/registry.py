"""The selector registry, names to classes. bmrt_kv.selectors fills it when it is imported;
a selector that builds others (hybrid) looks them up here at construction, so it imports
this small module rather than the package that imports it."""

from __future__ import annotations

import inspect

from bmrt_kv.errors import BMRTError, check_choice
from bmrt_kv.selectors.base import Selector

SELECTORS: dict[str, type[Selector]] = {}


def make_selector(name: str, options: dict | None = None, seed: int = 0) -> Selector:
    """Instantiate the selector registered as ``name``.

    Args:
        name: a key of :data:`SELECTORS`.
        options: the selector's keyword options (None: its defaults).
        seed: seeds its random projections.

    Returns:
        The selector.

    Raises:
        BMRTError: an unknown name, an unknown option or a bad value, naming the selector
            and the option.
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
