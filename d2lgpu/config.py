"""Settings read from the environment, in one place.

Two variables steer the course:

``D2LGPU_QUICK``
    ``1`` turns on quick mode: chapters shrink data sets, epochs and sweeps so
    that every notebook runs in seconds on a laptop CPU (the test suite sets
    it). Unset or ``0`` means full mode, which does the real work.
``D2LGPU_DATA``
    Where data sets live. Unset means a per-user cache directory
    (``~/.cache/d2lgpu/data`` on Linux), where they are downloaded once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TypeVar

QUICK_ENV = "D2LGPU_QUICK"
DATA_ENV = "D2LGPU_DATA"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

T = TypeVar("T")


def quick_mode() -> bool:
    """Return True when ``D2LGPU_QUICK`` asks for quick mode.

    Accepts 1/0, true/false, yes/no, on/off (any case). Anything else is an
    error rather than a guess, so a typo never silently runs the full course.
    """
    raw = os.environ.get(QUICK_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(
        f"{QUICK_ENV}={os.environ[QUICK_ENV]!r} is not understood: "
        f"set it to 1 for quick mode or 0 (or unset it) for full mode"
    )


def pick(full: T, quick: T) -> T:
    """Return ``quick`` in quick mode and ``full`` otherwise.

    Notebooks size their work with it, e.g. ``num_epochs = pick(full=10, quick=1)``.
    """
    return quick if quick_mode() else full


def default_cache_dir() -> Path:
    """The per-user cache directory of the course (not created here)."""
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "d2lgpu"


def data_root() -> Path:
    """The data root: ``D2LGPU_DATA`` when set, else ``<cache>/data``."""
    raw = os.environ.get(DATA_ENV, "").strip()
    if raw:
        return Path(raw).expanduser()
    return default_cache_dir() / "data"


def describe_mode() -> str:
    """One line saying which mode this process runs in, for notebooks to print."""
    if quick_mode():
        return (
            f"quick mode ({QUICK_ENV}=1): small data, few epochs; "
            "numbers are for checking, not for quoting"
        )
    return f"full mode ({QUICK_ENV} unset or 0): real data sizes and epochs"
