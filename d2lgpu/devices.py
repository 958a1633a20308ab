"""Naming devices: the CPU, one GPU, or all of them.

These follow "Dive into Deep Learning" (``d2l.try_gpu`` and friends) with one
deliberate difference: :func:`try_all_gpus` returns ``[cpu]`` on a machine
without GPUs, never an empty list. d2l returns ``[]`` there, and its training
loop then fails with ``IndexError`` on ``devices[0]``. A list with the CPU in
it lets code written for "a list of devices" run unchanged everywhere.
"""

from __future__ import annotations

import operator

import torch

__all__ = ["as_device", "cpu", "gpu", "num_gpus", "try_gpu", "try_all_gpus"]


def _check_index(i: object) -> int:
    # bool is a subclass of int; gpu(True) is almost certainly a mistake.
    if isinstance(i, bool):
        raise TypeError(f"a GPU index must be an int, got bool {i!r}")
    try:
        # operator.index accepts int-like values (e.g. numpy integers), not floats or strings.
        index = operator.index(i)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"a GPU index must be an int, got {type(i).__name__} {i!r}"
            + (f"; write {int(i)} instead" if isinstance(i, str) and i.strip().isdigit() else "")
        ) from None
    if index < 0:
        raise ValueError(
            f"a GPU index must be 0 or more, got {index}; GPUs are numbered 0, 1, ..."
        )
    return index


def as_device(device: torch.device | str | int) -> torch.device:
    """``torch.device(device)``, with an error that shows the accepted spellings.

    torch's own errors for a misspelt device list twenty device types or its C++
    overloads; this names the few that the course uses.
    """
    if isinstance(device, torch.device):
        return device
    hint = "use 'cpu', 'cuda', 'cuda:0' or torch.device('cuda', 0)"
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"{device!r} is not a device ({type(device).__name__}); {hint}")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{device!r} is not a device PyTorch understands; {hint}") from err


def cpu() -> torch.device:
    """The CPU device."""
    return torch.device("cpu")


def num_gpus() -> int:
    """How many CUDA GPUs this process can see (0 on a CPU-only build or machine).

    Honours ``CUDA_VISIBLE_DEVICES``: hidden GPUs are not counted.
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu(i: int = 0) -> torch.device:
    """The ``i``-th visible GPU; an error when it does not exist.

    Use :func:`try_gpu` to fall back to the CPU instead.
    """
    i = _check_index(i)
    n = num_gpus()
    if i >= n:
        raise RuntimeError(
            f"GPU {i} does not exist: this process sees {n} GPU(s). "
            f"Use d2lgpu.try_gpu({i}) to fall back to the CPU, "
            "or run `python -m d2lgpu info` to see why GPUs are missing."
        )
    return torch.device("cuda", i)


def try_gpu(i: int = 0) -> torch.device:
    """GPU ``i`` if it exists, else the CPU."""
    i = _check_index(i)
    return torch.device("cuda", i) if i < num_gpus() else cpu()


def try_all_gpus() -> list[torch.device]:
    """All visible GPUs, or ``[cpu]`` when there are none (never an empty list)."""
    n = num_gpus()
    return [torch.device("cuda", i) for i in range(n)] if n else [cpu()]
