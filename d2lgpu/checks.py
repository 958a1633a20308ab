"""Argument checks shared by the modules, so every one words its errors alike."""

from __future__ import annotations


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1; otherwise a ValueError naming ``name``.

    bool is refused although it is an int subclass: ``batch_size=True`` is a mistake.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_seed(value: object) -> int:
    """Return ``value`` if torch takes it as a seed (an int from 0 to 2**64 - 1); otherwise
    a ValueError with that range (torch itself says "Overflow when unpacking long")."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise ValueError(f"seed must be an int from 0 to 2**64 - 1, got {value!r}")
    return value


def check_bool(name: str, value: object, *, none_means: str | None = None) -> bool | None:
    """Return ``value`` if it is True or False (or None, when ``none_means`` says what
    None stands for); otherwise a TypeError naming ``name``.

    A truthy string such as ``"no"`` or ``"false"`` would otherwise read as True.
    """
    if isinstance(value, bool) or (value is None and none_means is not None):
        return value
    allowed = "True or False" + (f" (or None: {none_means})" if none_means else "")
    raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
