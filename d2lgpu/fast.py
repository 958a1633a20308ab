"""The fast path, one technique at a time: what each switch of :class:`Techniques` does.

:func:`d2lgpu.train` is the loop most learners start from: a CPU ``DataLoader``
decodes and copies every batch, and the GPU waits whenever the host falls behind.
For a data set as small as Fashion-MNIST (47 MB as uint8) that is pure overhead.
The fastest small-image training code (e.g. the CIFAR-10 speed runs) removes it
technique by technique, and :class:`Techniques` names each one as a switch of
:func:`d2lgpu.train` (chapter 7 turns them on one at a time and measures each):

``device_data``
    The images live on the device as uint8, four times smaller than float32, and
    are converted and normalised there, one batch at a time (:class:`d2lgpu.data.DeviceLoader`).
    Shuffling is a ``torch.randperm`` on the device from a seeded generator; a batch
    is an index into the resident tensors. No worker processes, no host copies.
``no_sync``
    Loss and correct counts are summed in device tensors and read once per epoch,
    so the host queues work far ahead of the GPU (d2l's loop reads them with
    ``.item()`` after every step, which waits for the GPU each time).
``precision``
    Not a switch but a word of :data:`d2lgpu.precision.PRECISIONS` (default ``"fp32"``). The fast
    path's ``"auto"`` runs the forward pass under autocast in the format the device
    runs fast (:func:`d2lgpu.precision_policy`: bf16 from Ampere on, fp16 with loss
    scaling before; on a CPU bf16 where it is native, else fp32).
``channels_last``
    Model and batches in NHWC, the layout of cuDNN's Tensor Core convolutions.
``fused_optimizer``
    One fused SGD kernel updates all parameters (:func:`make_sgd`); it also takes
    GradScaler's inf check on the device, so fp16 needs no host round trip either.
``compile``
    ``torch.compile`` fuses the model's operations into fewer, generated kernels
    (costs tens of seconds up front and needs a compiler toolchain).
``cuda_graphs``
    The model's kernels are recorded once as a CUDA graph and replayed, one launch
    per graph instead of one per kernel (:func:`compile_model`).

:meth:`Techniques.fast` is the fast path: every technique that pays off on the
device (:func:`technique_skip_reason` says why one does not), with ``compile`` and
``cuda_graphs`` to be asked for. Everything else is the plain recipe: same model, SGD,
cross-entropy, batch size, learning rate and initialisation, so accuracy is comparable.

This module holds the building blocks; :mod:`d2lgpu.training` imports them (never the
other way round) and runs the loop.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import shutil
import sys
from dataclasses import dataclass

import torch
from torch import nn

from d2lgpu import precision
from d2lgpu.checks import (
    check_finite_float,
    check_positive_float,
    check_sequence,
)
from d2lgpu.data import DeviceLoader
from d2lgpu.devices import as_device

__all__ = [
    "COMPILE_MODES",
    "TECHNIQUES",
    "Techniques",
    "as_device_loader",
    "compile_model",
    "make_sgd",
    "technique_skip_reason",
]

# --------------------------------------------------------------------------- #
# The switches
# --------------------------------------------------------------------------- #

#: The techniques of the fast path, in the order chapter 7's ablation adds them.
TECHNIQUES = (
    "device_data", "no_sync", "precision", "channels_last", "fused_optimizer", "compile",
    "cuda_graphs",
)

#: The techniques that are on/off switches (``precision`` is a word of PRECISIONS).
SWITCHES = tuple(name for name in TECHNIQUES if name != "precision")

#: ``Techniques.compile_mode`` values; CUDA graphs are a switch of their own.
COMPILE_MODES = ("default", "max-autotune")


@dataclass(frozen=True)
class Techniques:
    """Which speed techniques :func:`d2lgpu.train` uses: one switch per technique.

    ``Techniques()`` is the plain loop of :func:`d2lgpu.train` (``no_sync`` only, in
    strict fp32); :meth:`d2l_style` switches that off too, :meth:`fast` is the fast
    path. The module docstring says what each switch does. ``precision`` is a word of
    :data:`d2lgpu.precision.PRECISIONS`, on when it is not ``"fp32"``. ``compile_mode`` is the
    ``torch.compile`` mode when ``compile`` is on: ``"default"``, or
    ``"max-autotune"`` (tries several kernels per operation: far longer compiles).
    """

    device_data: bool = False
    no_sync: bool = True
    precision: str = "fp32"
    channels_last: bool = False
    fused_optimizer: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    compile_mode: str = "default"

    def __new__(cls, *args: object, **kwargs: object) -> Techniques:
        # Older chapter texts switched autocast on; there is one precision word now.
        if "autocast" in kwargs:
            raise TypeError(
                "Techniques has no autocast switch: write precision='auto' (the device's "
                "fast format) or another word of d2lgpu.precision.PRECISIONS; 'fp32' is off"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        precision.check_precision(self.precision, "Techniques.precision")
        for name in SWITCHES:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"Techniques.{name} is a switch: True or False, got {value!r}")
        if self.compile_mode not in COMPILE_MODES:
            hint = (
                " (that is compile=True with cuda_graphs=True)"
                if self.compile_mode == "reduce-overhead" else ""
            )
            raise ValueError(
                f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}{hint}"
            )

    @classmethod
    def d2l_style(cls) -> Techniques:
        """None of them: d2l's loop, which reads loss and accuracy after every step."""
        return cls(no_sync=False)

    @classmethod
    def fast(
        cls, device: torch.device | str, *, compile: bool = False, cuda_graphs: bool = False
    ) -> Techniques:
        """The fast path on ``device``: every technique up to the optimizer that pays off
        there (see :func:`technique_skip_reason`; precision ``"auto"`` where the device
        has a faster format than fp32), plus ``compile``/``cuda_graphs`` when asked for
        (they cost compile time up front)."""
        device = as_device(device)
        basic = TECHNIQUES[: TECHNIQUES.index("fused_optimizer") + 1]
        pays = {name: technique_skip_reason(name, device) is None for name in basic}
        pays["precision"] = "auto" if pays["precision"] else "fp32"
        return cls(**pays, compile=compile, cuda_graphs=cuda_graphs)

    def replace(self, **changes: bool | str) -> Techniques:
        """A copy with some fields changed, e.g. ``techniques.replace(compile=True)``."""
        return dataclasses.replace(self, **changes)

    @property
    def enabled(self) -> tuple[str, ...]:
        """The names of the techniques that are on (precision: not "fp32"), in
        :data:`TECHNIQUES` order."""
        return tuple(name for name in TECHNIQUES if getattr(self, name) not in (False, "fp32"))

    def __str__(self) -> str:
        names = list(self.enabled)
        if self.compile and self.compile_mode != "default":
            names[names.index("compile")] = f"compile ({self.compile_mode})"
        if "precision" in names:
            names[names.index("precision")] = f"precision {self.precision}"
        return " + ".join(names) if names else "none (d2l-style)"


def _has_cxx_compiler() -> bool:
    names = ("cl",) if sys.platform == "win32" else ("c++", "g++", "clang++")
    return any(shutil.which(name) for name in names)


def technique_skip_reason(technique: str, device: torch.device | str) -> str | None:
    """Why the fast path leaves ``technique`` out on ``device`` (one line of at most 64
    characters), or None when it uses it.

    Either the technique cannot run there (CUDA graphs on a CPU; ``torch.compile``
    without its compiler toolchain), or it buys nothing there: precision "auto" where
    the device's fast format is fp32, and channels-last and the fused optimizer on a CPU
    (both are CUDA-side wins: cuDNN's Tensor Core layout, fewer kernel launches).
    """
    if technique not in TECHNIQUES:
        raise ValueError(f"unknown technique {technique!r}; choose from {TECHNIQUES}")
    device = as_device(device)
    on_cuda = device.type == "cuda"
    if technique == "precision":
        if precision.precision_policy(device, "auto").dtype is not None:
            return None
        if device.type == "cpu":
            return "no native bf16 here: emulated bf16 is slower, 'auto' is fp32"
        return f"no fast reduced format on {device}: 'auto' is fp32"
    if technique == "channels_last" and not on_cuda:
        return "cuDNN's Tensor Core layout; mixed results on CPUs (RESULTS.md)"
    if technique == "fused_optimizer" and not on_cuda:
        return "saves CUDA kernel launches; a CPU launches none"
    if technique == "cuda_graphs" and not on_cuda:
        return "CUDA graphs replay CUDA kernels; a CPU runs none"
    if technique == "compile":
        if not torch._dynamo.is_dynamo_supported():
            return "torch.compile does not support this Python and torch"
        if on_cuda:
            from torch.utils._triton import has_triton

            # Inductor generates Triton kernels, and Triton supports compute capability
            # 7.0 and up (torch's GPUTooOldForTriton, in torch 2.9 as in 2.15); below it
            # has_triton() is False even with triton installed, so ask the GPU first.
            major, minor = torch.cuda.get_device_capability(device)
            if torch.version.hip is None and major < 7:
                return f"this GPU (sm{major}{minor}) is too old for Triton: it needs sm70+"
            if not has_triton():
                return "torch.compile on a GPU needs Triton (pip install triton)"
        elif not _has_cxx_compiler():
            return "torch.compile on a CPU needs a C++ compiler (g++ or clang++)"
    return None


# --------------------------------------------------------------------------- #
# What the switches use
# --------------------------------------------------------------------------- #


def make_sgd(
    params, lr: float, device: torch.device | str, *, momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> torch.optim.SGD:
    """SGD with the fastest step this torch offers on ``device``: fused, else foreach.

    The for-loop implementation launches kernels for each of the model's parameter
    tensors (76 for ResNet-18); ``foreach`` (torch's default on CUDA) groups them into
    a few multi-tensor kernels; ``fused`` does the whole update in one pass and can
    take GradScaler's scale and inf flag as device tensors, so loss scaling needs no
    host round trip. Fused SGD exists on CUDA and CPU in recent torch; where it does
    not, ``foreach`` is used.
    """
    params = check_sequence("params", params, of="parameters, e.g. net.parameters()")
    for p in params:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(f"params must hold tensors (or parameter-group dicts), got "
                            f"{type(p).__name__} {p!r} among them: pass net.parameters()")
    lr = check_positive_float("lr", lr)
    momentum = check_finite_float("momentum", momentum, minimum=0.0)
    weight_decay = check_finite_float("weight_decay", weight_decay, minimum=0.0)
    device = as_device(device)
    kwargs = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
    if "fused" in inspect.signature(torch.optim.SGD).parameters:
        try:
            from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

            fused_devices = _get_fused_kernels_supported_devices()
        except ImportError:  # older torch: fused SGD existed for CUDA only
            fused_devices = ["cuda"]
        if device.type in fused_devices:
            return torch.optim.SGD(params, fused=True, **kwargs)
    return torch.optim.SGD(params, foreach=True, **kwargs)


def as_device_loader(
    data: object,
    name: str,
    device: torch.device,
    *,
    batch_size: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    channels_last: bool = False,
) -> DeviceLoader:
    """``data`` as a :class:`DeviceLoader` on ``device``: a DeviceLoader already there, or,
    when ``batch_size`` is given, a pair (uint8 images, labels) put there now with the
    other arguments. Anything else is an error that names the fix."""
    if isinstance(data, DeviceLoader):
        if data.device != device:
            raise ValueError(
                f"{name} lives on {data.device} but training runs on {device}: build the "
                f"loader on {device} (e.g. d2lgpu.fashion_mnist_on_device(..., device))"
            )
        return data
    is_pair = isinstance(data, (tuple, list)) and len(data) == 2 and all(
        isinstance(t, torch.Tensor) for t in data
    )
    if is_pair and batch_size is not None:
        return DeviceLoader(
            data[0], data[1], batch_size, device=device, shuffle=shuffle, seed=seed,
            channels_last=channels_last,
        )
    accepted = "a d2lgpu.DeviceLoader" + (
        " or a pair (uint8 images, labels)" if batch_size is not None else ""
    )
    raise TypeError(
        f"{name} must be {accepted}, got {type(data).__name__}. The fast path keeps the "
        "data set on the device instead of reading a DataLoader: use "
        "d2lgpu.fashion_mnist_on_device(batch_size, device) (or d2lgpu.train_fast with "
        "tensor pairs), or switch device_data off (plain d2lgpu.Techniques()) to read a DataLoader."
    )


def compile_model(net: nn.Module, techniques: Techniques, device: torch.device | str) -> nn.Module:
    """``net`` as ``techniques`` asks: itself, or a ``torch.compile`` wrapper sharing its weights.

    ``compile`` uses the inductor compiler (mode ``"default"`` or
    ``"max-autotune-no-cudagraphs"``). ``cuda_graphs`` with ``compile`` is mode
    ``"reduce-overhead"`` (or ``"max-autotune"``), inductor's kernels replayed as CUDA
    graphs; ``cuda_graphs`` alone is the ``"cudagraphs"`` backend, which records the
    eager kernels of the forward and backward passes as graphs. Either way torch
    re-records a graph for each new input shape (e.g. a smaller last batch). A
    technique that cannot run on ``device`` is an error that says why.
    """
    device = as_device(device)
    for name in ("compile", "cuda_graphs"):
        if getattr(techniques, name):
            reason = technique_skip_reason(name, device)
            if reason is not None:
                raise ValueError(f"{name}=True cannot run on {device}: {reason}")
    if techniques.compile and device.type == "cpu":
        # Inductor's C++ backend loads torch.utils.cpp_extension, which warns on a machine
        # without CUDA that it found no CUDA runtime: true, and irrelevant to CPU kernels.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    if techniques.compile:
        modes = {
            ("default", False): None,
            ("default", True): "reduce-overhead",
            ("max-autotune", False): "max-autotune-no-cudagraphs",
            ("max-autotune", True): "max-autotune",
        }
        return torch.compile(net, mode=modes[techniques.compile_mode, techniques.cuda_graphs])
    if techniques.cuda_graphs:
        return torch.compile(net, backend="cudagraphs")
    return net
