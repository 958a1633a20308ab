"""Argument checks shared by the modules, so every one words its errors alike."""

from __future__ import annotations

import math
import os
from numbers import Real
from pathlib import Path

__all__ = [
    "DIVERGENCE_FACTOR", "check_batch", "check_bool", "check_capability", "check_finite_tensors",
    "check_loader", "check_module", "check_positive_float", "check_positive_int", "check_seed",
    "check_tensor", "check_training_loss", "check_warmup_repeats", "check_writable_path",
    "error_line", "find_non_finite_batch", "loss_diverged",
]


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (not a bool); else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_seed(value: object) -> int:
    """``value`` if torch takes it as a seed (an int from 0 to 2**64 - 1); else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise ValueError(f"seed must be an int from 0 to 2**64 - 1, got {value!r}")
    return value


def check_bool(name: str, value: object, *, none_means: str | None = None) -> bool | None:
    """``value`` if it is True or False (or None, when ``none_means`` says what None stands
    for); else a TypeError naming ``name``: a string such as ``"no"`` would read as True."""
    if isinstance(value, bool) or (value is None and none_means is not None):
        return value
    allowed = "True or False" + (f" (or None: {none_means})" if none_means else "")
    raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")


def check_capability(capability: object) -> tuple[int, int]:
    """``capability`` if it is a (major, minor) tuple of ints; else a TypeError."""
    if not (
        isinstance(capability, tuple) and len(capability) == 2
        and all(isinstance(c, int) and not isinstance(c, bool) for c in capability)
    ):
        raise TypeError(f"capability must be a (major, minor) tuple of ints, got {capability!r}")
    return capability  # type: ignore[return-value]


def check_warmup_repeats(warmup: object, repeats: object) -> None:
    """A ValueError naming the count, unless ``repeats`` is an int >= 1 and ``warmup`` >= 0."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int of at least 1, got {repeats!r}; try repeats=10")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int of 0 or more, got {warmup!r}; try warmup=2")


def check_positive_float(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number > 0; else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def error_line(error: BaseException) -> str:
    """An error as one line of a message: ``"TypeName: the first line of its text"``."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _given(value: object) -> str:
    """How an error shows what it was given: the type, and the value cut to 60 characters."""
    text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    plain = value is None or isinstance(value, (bool, int, float, str))
    return text if plain else f"{type(value).__name__} {text}"


def check_module(name: str, value: object):
    """``value`` if it is a ``torch.nn.Module``; else a TypeError naming ``name``."""
    from torch import nn

    if not isinstance(value, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module (a model or a layer, e.g. "
                        f"d2lgpu.resnet18()), got {_given(value)}")
    return value


def check_tensor(name: str, value: object, *, dtype: str | None = None):
    """``value`` if it is a torch.Tensor, floating-point with ``dtype="floating"``; else a
    TypeError naming ``name`` and the fix."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_given(value)}: pass a tensor "
                        "(torch.as_tensor converts lists and NumPy arrays)")
    if dtype == "floating" and not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}: convert it "
                        "with .float()")
    return value


def _count_non_finite(tensors) -> tuple[int, int]:
    """(NaN count, inf count) over the tensors among ``tensors``, read with one host sync."""
    import torch

    counts = [torch.stack([t.isnan().sum(), t.isinf().sum()]) for t in tensors
              if isinstance(t, torch.Tensor)]
    if not counts:
        return 0, 0
    nans, infs = torch.stack([c.to(counts[0].device) for c in counts]).sum(dim=0).tolist()
    return nans, infs


def check_finite_tensors(what: str, tensors, *, fix: str = "") -> None:
    """A ValueError counting the NaNs and infs in ``tensors``, named by ``what``, with ``fix``."""
    nans, infs = _count_non_finite(list(tensors))
    if nans or infs:
        found = " and ".join(f"{n} {kind}" for n, kind in ((nans, "NaN"), (infs, "inf")) if n)
        raise ValueError(f"{what} hold {found} value(s). {fix}".rstrip())


def check_loader(name: str, value: object) -> object:
    """``value`` if it can be iterated for batches (a tensor gives rows, not batches) and is
    not known to be empty."""
    import torch

    if isinstance(value, (str, bytes, torch.Tensor)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must yield batches (X, y), got {_given(value)}: pass a "
                        "DataLoader (e.g. d2lgpu.load_data_fashion_mnist's) or a list of batches")
    if hasattr(value, "__len__") and len(value) == 0:  # type: ignore[arg-type]
        raise ValueError(f"{name} is empty (length 0): it has no batches. Check the data set's "
                         "size against the batch size (drop_last=True drops a last partial batch)")
    return value


def check_batch(name: str, batch: object, index: int):
    """``(X, y)`` if ``batch`` is a pair of tensors with as many labels as examples; else an
    error naming the loader and the batch number, not an unpacking error in the loop."""
    import torch

    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise TypeError(f"batch {index} of {name} is {_given(batch)}: every batch must be a pair "
                        "(X, y) of an input tensor and a label tensor")
    X, y = batch
    if X.dim() == 0 or y.dim() == 0 or X.shape[0] != y.shape[0]:
        raise ValueError(f"batch {index} of {name} has X of shape {tuple(X.shape)} and y of shape "
                         f"{tuple(y.shape)}: both need the batch dimension first, of one size")
    return X, y


def find_non_finite_batch(name: str, loader: object) -> str | None:
    """Which batch of ``loader`` first holds NaN or inf in its inputs, as a sentence; None
    when none does. Reads the whole loader once: for diagnosing a failed run only."""
    for index, batch in enumerate(loader):  # type: ignore[attr-defined]
        X = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
        nans, infs = _count_non_finite([X])
        if nans or infs:
            return (f"batch {index} of {name} holds {nans} NaN and {infs} inf input value(s): "
                    "the data are broken, not the training. Clean or drop those examples "
                    "(e.g. torch.nan_to_num, or check how the data were normalised)")
    return None


#: The course's one rule for "training diverged": a loss that is NaN or inf, or more than
#: this many times the loss the run started from (or than 1, for losses that start below 1):
#: far beyond one batch's noise, and well before the float overflows.
DIVERGENCE_FACTOR = 10.0


def loss_diverged(loss: float, first_loss: float | None) -> bool:
    """True when ``loss`` breaks the divergence rule against ``first_loss`` (None: only
    finiteness is judged)."""
    if not math.isfinite(loss):
        return True
    if first_loss is None or not math.isfinite(first_loss):
        return False
    return loss > max(1.0, abs(first_loss)) * DIVERGENCE_FACTOR


def check_training_loss(loss: float, *, when: str, lr: float, first_loss: float | None = None,
                        advice: str = "") -> None:
    """A FloatingPointError when a training loss breaks the divergence rule, naming
    ``when`` (``"step 12"``), the learning rate and ``advice``."""
    if not loss_diverged(loss, first_loss):
        return
    what = (f"grew to {loss:.3g}, more than {DIVERGENCE_FACTOR:g} times the {first_loss:.3g} it "
            "started from," if math.isfinite(loss) else f"became {loss}")
    tail = f", {advice}" if advice else ""
    raise FloatingPointError(f"the training loss {what} in {when}: training diverged at lr "
                             f"{lr:g}. Try a smaller lr (this run: {lr:g}){tail}.")


def check_writable_path(name: str, value: object, *, kind: str = "file") -> Path:
    """``value`` as a Path where a ``kind`` ("file" or "directory") can be written, checked
    before any work (nothing is created): not under /proc, /sys or /dev, no file in the way,
    a writable nearest parent."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise TypeError(f"{name} must be a path (a non-empty str or a pathlib.Path), got "
                        f"{_given(value)}")
    path = Path(value).expanduser()
    absolute = path.absolute()
    for system in ("/proc", "/sys", "/dev"):
        if absolute.is_relative_to(system):
            raise ValueError(f"{name}={str(value)!r} is under {system}, a system file system that "
                             "holds no ordinary files: choose a path in your home, working or "
                             "temporary directory")
    if kind == "file" and path.is_dir():
        raise ValueError(f"{name}={str(value)!r} is a directory: name a file in it")
    if kind == "directory" and path.exists() and not path.is_dir():
        raise ValueError(f"{name}={str(value)!r} is a file, not a directory: name a directory "
                         "(it is created when missing)")
    existing = next(p for p in (absolute, *absolute.parents) if p.exists())
    if existing != absolute and not existing.is_dir():
        raise ValueError(f"{name}={str(value)!r} cannot be created: {existing} is a regular file, "
                         "not a directory. Choose another path, or move that file away")
    if not os.access(existing, os.W_OK):
        raise PermissionError(f"{name}={str(value)!r} cannot be written: {existing} is not "
                              "writable by this user. Choose a directory you can write to")
    return path
