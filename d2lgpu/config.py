"""Settings read from the environment, in one place.

Every chapter runs one of three workloads:

``quick``
    Tiny data, few steps: every notebook runs in seconds (the test suite sets
    ``D2LGPU_QUICK=1``). The numbers are for checking, not for quoting.
``cpu``
    The default where no CUDA GPU is usable: workloads cut so that each
    chapter finishes in minutes on a laptop CPU and its training still learns.
``full``
    The default with a CUDA GPU: the real data sizes and epochs. On a CPU,
    ``D2LGPU_FULL=1`` forces it (expect hours for the ResNet-18 chapters).

Three variables steer the course:

``D2LGPU_QUICK``
    ``1`` selects the quick workload; it wins over ``D2LGPU_FULL``.
``D2LGPU_FULL``
    ``1`` selects the full workload even without a GPU.
``D2LGPU_DATA``
    Where data sets live. Unset means a per-user cache directory
    (``~/.cache/d2lgpu/data`` on Linux), where they are downloaded once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal, TypeVar

QUICK_ENV = "D2LGPU_QUICK"
FULL_ENV = "D2LGPU_FULL"
DATA_ENV = "D2LGPU_DATA"

Workload = Literal["quick", "cpu", "full"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

T = TypeVar("T")


def _env_flag(name: str) -> bool:
    """Read a yes/no environment variable; unset or empty means no.

    Accepts 1/0, true/false, yes/no, on/off (any case). Anything else is an
    error rather than a guess, so a typo never silently picks a workload.
    """
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r} is not understood: set it to 1 (yes) or 0 (no), "
        f"or unset it"
    )


def quick_mode() -> bool:
    """Return True when ``D2LGPU_QUICK`` asks for the quick workload."""
    return _env_flag(QUICK_ENV)


def _cuda_usable() -> bool:
    # Imported here so that reading a setting does not import torch by itself.
    import torch

    return torch.cuda.is_available()


def workload() -> Workload:
    """The workload this process runs: ``"quick"``, ``"cpu"`` or ``"full"``.

    ``D2LGPU_QUICK=1`` gives quick, else ``D2LGPU_FULL=1`` gives full, else
    full where a CUDA GPU is usable and cpu where none is.
    """
    if quick_mode():
        return "quick"
    if _env_flag(FULL_ENV):
        return "full"
    return "full" if _cuda_usable() else "cpu"


_SAME_AS_FULL = object()


def pick(full: T, quick: T, cpu: T = _SAME_AS_FULL) -> T:  # type: ignore[assignment]
    """Return the value for this process's workload.

    Notebooks size their work with it, e.g.
    ``num_epochs = pick(full=10, quick=1, cpu=3)``. Leave ``cpu`` out only for
    sizes that are cheap on a CPU too: it then defaults to ``full``.
    """
    chosen = workload()
    if chosen == "quick":
        return quick
    if chosen == "cpu" and cpu is not _SAME_AS_FULL:
        return cpu
    return full


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
    """One line saying which workload this process runs, for notebooks to print."""
    chosen = workload()
    if chosen == "quick":
        return (
            f"quick mode ({QUICK_ENV}=1): tiny data, few steps; "
            "numbers are for checking, not for quoting"
        )
    if chosen == "cpu":
        return (
            "CPU mode (no CUDA GPU): workloads cut to finish in minutes; "
            f"{FULL_ENV}=1 runs the real ones"
        )
    if _cuda_usable():
        return "full mode: real data sizes and epochs"
    return f"full mode on a CPU ({FULL_ENV}=1): real data sizes and epochs, expect hours"
