"""Naming devices: the CPU, one GPU, or all of them; and the one place that resolves them.

These follow "Dive into Deep Learning" (``d2l.try_gpu`` and friends) with one
deliberate difference: :func:`try_all_gpus` returns ``[cpu]`` on a machine
without GPUs, never an empty list. d2l returns ``[]`` there, and its training
loop then fails with ``IndexError`` on ``devices[0]``. A list with the CPU in
it lets code written for "a list of devices" run unchanged everywhere.

Every function of the package that takes a device resolves it with one of three:
``as_device`` (in the runtime's ``gpus``, with the GPU counts) reads one spelling
(``'cuda:1'``, ``torch.device('cpu')``, ``0``); :func:`require_cuda_device` also makes
sure that a CUDA device exists in this process and names its GPU (``'cuda'`` becomes the
current GPU, as torch reads it); and :func:`resolve_devices` turns ``None``, one device
or a list into the non-empty list of distinct devices a training loop runs on.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from d2lgpu.runtime.gpus import as_device, num_gpus

__all__ = [
    "cpu",
    "gpu",
    "require_cuda_device",
    "resolve_devices",
    "try_gpu",
    "try_all_gpus",
]


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


def cpu() -> torch.device:
    """The CPU device."""
    return torch.device("cpu")


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
    """GPU ``i`` if it exists and this process can use it (:func:`num_gpus`), else the CPU."""
    i = _check_index(i)
    return torch.device("cuda", i) if i < num_gpus() else cpu()


def try_all_gpus() -> list[torch.device]:
    """All visible GPUs, or ``[cpu]`` when none is usable (never an empty list)."""
    n = num_gpus()
    return [torch.device("cuda", i) for i in range(n)] if n else [cpu()]


def require_cuda_device(device: torch.device | str | int, what: str) -> torch.device:
    """``device`` with its GPU index filled in, once it is clear that CUDA can use it here.

    Every function of the package that takes a device calls this before touching CUDA,
    so that ``'cuda'`` on a machine without a usable GPU fails with what to do, not
    torch's bare "Found no NVIDIA driver". ``what`` names the caller in the message. A
    device that is not CUDA is returned unchanged; a bare ``'cuda'`` becomes the current
    GPU, as torch reads it. Why CUDA is missing is chapter 1's diagnosis
    (``python -m d2lgpu info``, :func:`d2lgpu.diagnose_this_machine`), which the message
    points to: this module sits below it.
    """
    if not isinstance(what, str) or not what:
        raise TypeError(f"what must name the caller for the message (a non-empty str), "
                        f"got {type(what).__name__} {what!r}")
    device = as_device(device)
    if device.type != "cuda":
        return device
    count = num_gpus()
    if count == 0:
        if torch.version.cuda is None:
            cause = "this PyTorch is a CPU-only build"
        elif torch.cuda.is_available():
            cause = "this PyTorch has no kernels for a GPU here"
        else:
            cause = "this PyTorch finds no usable GPU"
        raise RuntimeError(
            f"{what} was given {device}, but this process cannot use CUDA: {cause}.\n"
            "Run `python -m d2lgpu info` (or print(d2lgpu.diagnose_this_machine())) to see "
            "why and how to fix it.\n"
            "To run on the CPU instead, pass d2lgpu.try_gpu() (it is the CPU when there is no GPU)."
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise RuntimeError(
            f"{what} was given {device}, but {device} does not exist: this process sees {count} "
            f"GPU(s), numbered 0 to {count - 1}. Run `python -m d2lgpu info` to see them."
        )
    return torch.device("cuda", index)


def resolve_devices(
    devices: torch.device | str | Sequence[torch.device | str] | None,
    what: str = "train",
) -> list[torch.device]:
    """Turn ``devices`` into a non-empty list of distinct devices that a training loop can use.

    ``None`` means all GPUs, or the CPU without GPUs. Each device is checked with
    :func:`require_cuda_device` (``what`` names the caller). Several CPU devices, or
    CPU mixed with GPUs, are an error: ``nn.DataParallel`` splits batches across CUDA
    devices only.
    """
    if devices is None:
        return try_all_gpus()
    if isinstance(devices, (str, torch.device, int)):
        devices = [devices]
    if not isinstance(devices, (list, tuple)):
        raise TypeError(
            f"devices must be None (all GPUs, or the CPU), one device such as 'cuda:0', or a "
            f"list of them, got {type(devices).__name__} {devices!r}"
        )
    for d in devices:
        # torch reads an int as a GPU index; here it is more often a count or a typo.
        if isinstance(d, int):
            raise TypeError(
                f"devices={d!r} is an int: name the device instead, e.g. 'cuda:{d}' or "
                f"d2lgpu.gpu({d}) for a GPU, 'cpu' for the CPU"
            )
    resolved = [as_device(d) for d in devices]
    if not resolved:
        raise ValueError("devices is empty: pass None for all GPUs (or the CPU), or a device list")
    for d in resolved:
        if d.type not in ("cpu", "cuda"):
            raise ValueError(
                f"{what} cannot use {d.type!r} devices: pass 'cpu', 'cuda', 'cuda:1', a list "
                "of CUDA devices, or None for all GPUs (the CPU without GPUs)"
            )
    resolved = [require_cuda_device(d, what) for d in resolved]
    if len(resolved) > 1:
        if any(d.type != "cuda" for d in resolved):
            raise ValueError(
                f"cannot train on {[str(d) for d in resolved]}: data parallelism here needs CUDA "
                "devices only. Use one CPU device (devices=[d2lgpu.cpu()]), or see chapter 3 "
                "for splitting a batch by hand with d2lgpu.split_batch."
            )
        if len({d.index for d in resolved}) != len(resolved):
            raise ValueError(f"devices repeats a GPU: {[str(d) for d in resolved]}")
    return resolved
















