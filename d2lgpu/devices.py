"""Naming devices: the CPU, one GPU, or all of them (chapters 1 and 3), as d2l's ``try_gpu``,
except that :func:`try_all_gpus` returns ``[cpu]``, never ``[]``, on a machine without GPUs;
and the devices a training loop is given, checked (:func:`resolve_devices`, chapter 4)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from d2lgpu.runtime.gpus import num_gpus, require_cuda_device

__all__ = ["cpu", "gpu", "resolve_devices", "try_gpu", "try_all_gpus"]


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
    return [torch.device("cuda", i) for i in range(num_gpus())] or [cpu()]


def resolve_devices(devices: torch.device | str | Sequence[torch.device | str] | None,
                    what: str = "train") -> list[torch.device]:
    """``devices`` as a non-empty list of distinct devices a training loop can use: None is
    :func:`try_all_gpus`; several devices must all be GPUs, as DataParallel needs."""
    if devices is None:
        return try_all_gpus()
    devices = [devices] if isinstance(devices, (str, torch.device, int)) else devices
    if not isinstance(devices, (list, tuple)) or not devices:
        raise TypeError(f"devices must be None (all GPUs, or the CPU), one device such as "
                        f"'cuda:0', or a non-empty list of them, got {devices!r}")
    for d in devices:  # torch reads an int as a GPU index; here it is more often a count or typo
        if isinstance(d, int):
            raise TypeError(f"devices={d!r} is an int: name the device instead, e.g. 'cuda:{d}' "
                            f"or d2lgpu.gpu({d}) for a GPU, 'cpu' for the CPU")
    resolved = [require_cuda_device(d, what) for d in devices]
    types, names = [d.type for d in resolved], [str(d) for d in resolved]
    if types != ["cpu"] and set(types) != {"cuda"}:
        raise ValueError(f"{what} cannot use {names}: it runs on one CPU device ('cpu') or on "
                         "CUDA devices only ('cuda:1', a list of them, or None for all GPUs), as "
                         "DataParallel needs. To split a batch by hand, see chapter 3's "
                         "d2lgpu.split_batch.")
    if len(set(resolved)) < len(resolved):
        raise ValueError(f"devices repeats a GPU: {names}")
    return resolved
