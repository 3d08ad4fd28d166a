"""bmrt-kv's error type and the argument checks that raise it."""

from __future__ import annotations

#: Largest token count a budget, block or window may have: positions are int64 and every
#: tensor dimension stays far below 2**31, so anything larger is a mistake.
MAX_TOKENS = 2**31 - 1


class BMRTError(ValueError):
    """A bad configuration or input: the message names the field and what was expected.

    A ValueError, so callers that catch ValueError keep working.
    """


def check_int(where: str, value, low: int, high: int, odd: bool = False) -> int:
    """``value`` if it is an int (bools excluded) in [low, high] (odd when ``odd``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an odd int" if odd else "an int"
        raise BMRTError(f"{where} must be {kind} in [{low}, {high}], got {value!r}")
    if not low <= value <= high or (odd and value % 2 == 0):
        kind = "an odd int" if odd else "an int"
        raise BMRTError(f"{where} must be {kind} in [{low}, {high}], got {value}")
    return value


def check_fraction(where: str, value, low_open: bool) -> float:
    """``value`` as a float if it is a finite real number in (0, 1] (``low_open``) or [0, 1]."""
    interval = "(0, 1]" if low_open else "[0, 1]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BMRTError(f"{where} must be a number in {interval}, got {value!r}")
    # Compared before float() so that a huge int cannot overflow; NaN fails every comparison.
    inside = 0 < value <= 1 if low_open else 0 <= value <= 1
    if not inside:
        raise BMRTError(f"{where} must be a number in {interval}, got {value!r}")
    return float(value)


def check_choice(where: str, value, allowed) -> str:
    """``value`` if it is a str among ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        raise BMRTError(f"{where} must be one of {sorted(allowed)}, got {value!r}")
    return value
