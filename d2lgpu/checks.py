"""Argument checks shared by the modules, so every one words its errors alike."""

from __future__ import annotations


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1; otherwise a ValueError naming ``name``.

    bool is refused although it is an int subclass: ``batch_size=True`` is a mistake.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
