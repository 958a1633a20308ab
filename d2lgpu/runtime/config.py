"""The workload of every chapter, and where data lives, read from the environment.

Workloads: ``quick`` (tiny data, few steps; ``D2LGPU_QUICK=1``, which wins), ``cpu`` (cut
to minutes, the default without a usable GPU) and ``full`` (the real sizes; the default
with a GPU, forced by ``D2LGPU_FULL=1``). ``D2LGPU_SMOKE=1`` runs full mode's code with
quick amounts of work (CI). ``D2LGPU_DATA`` is the data root; ``D2LGPU_CPU_BF16`` (1 or
0) overrides what the course reads about this CPU's bf16 instructions.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal, TypeVar

__all__ = [
    "CPU_BF16_ENV", "DATA_ENV", "FULL_ENV", "QUICK_ENV", "SMOKE_ENV", "Workload",
    "cpu_bf16_override", "data_root", "default_cache_dir", "describe_mode", "pick",
    "quick_mode", "small_data", "smoke_mode", "workload",
]

QUICK_ENV = "D2LGPU_QUICK"
FULL_ENV = "D2LGPU_FULL"
SMOKE_ENV = "D2LGPU_SMOKE"
DATA_ENV = "D2LGPU_DATA"
CPU_BF16_ENV = "D2LGPU_CPU_BF16"

Workload = Literal["quick", "cpu", "full"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

T = TypeVar("T")


def _env_flag(name: str) -> bool:
    """A yes/no variable (1/0, true/false, yes/no, on/off; unset: no); anything else is
    an error, so that a typo never silently picks a workload."""
    raw = os.environ.get(name, "").strip().lower()
    if raw not in _TRUE | _FALSE:
        raise ValueError(f"{name}={os.environ[name]!r} is not understood: set it to 1 (yes) or 0 "
                         "(no), or unset it")
    return raw in _TRUE


def quick_mode() -> bool:
    """Return True when ``D2LGPU_QUICK`` asks for the quick workload."""
    return _env_flag(QUICK_ENV)


def smoke_mode() -> bool:
    """True when ``D2LGPU_SMOKE`` asks for full mode's code path with the work cut (and
    ``D2LGPU_QUICK`` does not win over it)."""
    return _env_flag(SMOKE_ENV) and not quick_mode()


def small_data() -> bool:
    """True where data sets are cut to the quick subsets: quick mode and smoke mode."""
    return quick_mode() or smoke_mode()


def cpu_bf16_override() -> bool | None:
    """What ``D2LGPU_CPU_BF16`` says about this CPU's bf16 instructions; None when unset."""
    if not os.environ.get(CPU_BF16_ENV, "").strip():
        return None
    return _env_flag(CPU_BF16_ENV)


def _cuda_usable() -> bool:
    from d2lgpu.runtime.gpus import cuda_usable  # here: reading a setting imports no torch

    return cuda_usable()


def workload(cuda: bool | None = None) -> Workload:
    """The workload this process runs: ``"quick"``, ``"cpu"`` or ``"full"``; ``cuda``: whether
    CUDA is usable, where the caller has read it already."""
    if quick_mode():
        return "quick"
    if _env_flag(FULL_ENV) or smoke_mode():
        return "full"
    return "full" if (_cuda_usable() if cuda is None else cuda) else "cpu"


_SAME_AS_FULL = object()


def _is_amount(value: object) -> bool:
    """Whether a pick()ed value sizes work (numbers, or containers of them), not a choice."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(map(_is_amount, value))
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def pick(full: T, quick: T, cpu: T = _SAME_AS_FULL, smoke: T = _SAME_AS_FULL) -> T:  # type: ignore[assignment]
    """The value for this process's workload, e.g. ``pick(full=10, quick=1, cpu=3)``; ``cpu``
    defaults to ``full``. Smoke mode takes amounts (numbers, and containers of them) from
    ``quick`` and every other choice from ``full``, unless ``smoke`` is given."""
    chosen = workload()
    if chosen == "quick":
        return quick
    if smoke_mode():
        if smoke is not _SAME_AS_FULL:
            return smoke
        return quick if _is_amount(full) else full
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


def describe_mode(cuda: bool | None = None) -> str:
    """One line saying which workload this process runs, for notebooks to print (``cuda`` as
    for :func:`workload`)."""
    chosen = workload(cuda)
    if chosen == "quick":
        return (f"quick mode ({QUICK_ENV}=1): tiny data, few steps; numbers are for checking, "
                "not for quoting")
    if chosen == "cpu":
        return (f"CPU mode (no CUDA GPU): workloads cut to finish in minutes; {FULL_ENV}=1 runs "
                "the real ones")
    if smoke_mode():
        return (f"smoke mode ({SMOKE_ENV}=1): full mode's code path with the work cut to a few "
                "steps; the numbers are for checking that it runs")
    if _cuda_usable() if cuda is None else cuda:
        return "full mode: real data sizes and epochs"
    return f"full mode on a CPU ({FULL_ENV}=1): real data sizes and epochs, expect hours"
