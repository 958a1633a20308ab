"""Argument checks shared by the modules, so every one words its errors alike."""

from __future__ import annotations

import math
from numbers import Real


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1; otherwise a ValueError naming ``name``.

    bool is refused although it is an int subclass: ``batch_size=True`` is a mistake.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_non_negative_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 0 (a seed); otherwise a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def check_positive_float(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a finite number > 0, else a ValueError naming ``name``.

    nan and inf are refused: an infinite learning rate or timeout is a mistake,
    and nan compares false with everything, so it would slip through ``> 0``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)
