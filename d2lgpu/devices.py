"""Naming devices: the CPU, one GPU, or all of them (chapters 1 and 3), as d2l's ``try_gpu``,
except that :func:`try_all_gpus` returns ``[cpu]``, never ``[]``, on a machine without GPUs."""

from __future__ import annotations

import operator

import torch

from d2lgpu.runtime.gpus import num_gpus

__all__ = ["cpu", "gpu", "try_gpu", "try_all_gpus"]


def _check_index(i: object) -> int:
    # bool is a subclass of int; __index__ takes numpy integers but no floats or strings.
    if isinstance(i, bool) or not hasattr(type(i), "__index__"):
        hint = f"; write {int(i)} instead" if isinstance(i, str) and i.strip().isdigit() else ""
        raise TypeError(f"a GPU index must be an int, got {type(i).__name__} {i!r}{hint}")
    index = operator.index(i)  # type: ignore[arg-type]
    if index < 0:
        raise ValueError(f"a GPU index must be 0 or more, got {index}; GPUs are numbered 0, 1, ...")
    return index


def cpu() -> torch.device:
    """The CPU device (chapter 3)."""
    return torch.device("cpu")


def gpu(i: int = 0) -> torch.device:
    """The ``i``-th visible GPU; an error when it does not exist (:func:`try_gpu` falls back)."""
    i = _check_index(i)
    n = num_gpus()
    if i >= n:
        raise RuntimeError(f"GPU {i} does not exist: this process sees {n} GPU(s). Use "
                           f"d2lgpu.try_gpu({i}) to fall back to the CPU, or run `python -m "
                           "d2lgpu info` to see why GPUs are missing.")
    return torch.device("cuda", i)


def try_gpu(i: int = 0) -> torch.device:
    """GPU ``i`` if it exists and this process can use it, else the CPU (chapter 1)."""
    i = _check_index(i)
    return torch.device("cuda", i) if i < num_gpus() else cpu()


def try_all_gpus() -> list[torch.device]:
    """All visible GPUs, or ``[cpu]`` when none is usable (never an empty list) (chapter 1)."""
    n = num_gpus()
    return [torch.device("cuda", i) for i in range(n)] if n else [cpu()]
