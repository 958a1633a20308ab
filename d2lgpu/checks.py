"""Argument checks shared by the modules, so every one words its errors alike."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from numbers import Real


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


def flag_type(check: Callable[[str, object], object], parse: type) -> Callable[[str], object]:
    """An argparse ``type=`` that parses with ``parse`` and checks with one of the checks here.

    argparse turns the error into a usage error: ``argument --epochs: must be ...``, exit 2.
    """

    def convert(text: str) -> object:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an int' if parse is int else 'a number'}, got {text!r}"
            ) from None
        try:
            return check("value", value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    convert.__name__ = check.__name__.removeprefix("check_")
    return convert


#: argparse types for the command-line trainers: a positive int, a seed, a positive number.
positive_int_flag = flag_type(check_positive_int, int)
seed_flag = flag_type(lambda _name, value: check_seed(value), int)
positive_number_flag = flag_type(check_positive_float, float)
