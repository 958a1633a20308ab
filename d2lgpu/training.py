"""Training and evaluation loops for image classifiers on the CPU, one GPU or all GPUs.

:func:`train` is d2l's ``train_ch13`` made safe to run anywhere and reproducible:

* ``devices=None`` means :func:`d2lgpu.try_all_gpus`, which is ``[cpu]`` without a
  GPU, so the loop never indexes an empty list (d2l raises ``IndexError`` there).
* Every parameter and batch-norm statistic is re-initialised under ``seed`` at the
  start, so a model object reused for a second run does not silently continue from
  the first (d2l re-initialises only the conv and linear weights).
* Loss and correct counts accumulate on the device and are read once per epoch,
  instead of forcing a host-device synchronisation on every batch.
* ``lr`` may be an :class:`SGDRecipe` instead of a number: momentum, weight decay,
  and a warm-up that ramps the learning rate up linearly, which large batches with a
  linearly scaled learning rate need (Goyal et al., 2017).
* ``precision`` takes the course's one vocabulary (:data:`d2lgpu.precision.PRECISIONS`) and
  trains under :func:`d2lgpu.precision_policy`'s autocast, loss scaling and TF32 setting.
* ``techniques`` switches on the fast path's techniques one by one
  (:class:`d2lgpu.Techniques`: data on the device, a precision, channels-last, a fused
  optimizer, ``torch.compile``, CUDA graphs); ``Techniques.fast(device)`` is all that
  pay off on the device. :func:`train_fast` is that, with the data given as tensors.

The body of one epoch is :func:`train_epoch`, so that other training paths can reuse
it or replace it without copying the set-up in :func:`train`. The switches and their
building blocks (:class:`Techniques`, :func:`technique_skip_reason`, :func:`make_sgd`,
:func:`compile_model`) live here, beside the loop that runs them; chapter 7 teaches them
one at a time, and its module :mod:`d2lgpu.fast` names them for that chapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import random
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from d2lgpu.data import DeviceLoader
from d2lgpu.devices import resolve_devices, try_gpu
from d2lgpu.plotting import LivePlot, in_notebook
from d2lgpu.precision import PrecisionPolicy, check_precision, precision_policy
from d2lgpu.runtime.checks import (
    check_batch,
    check_bool,
    check_finite_float,
    check_finite_tensors,
    check_loader,
    check_module,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_sequence,
    check_training_loss,
    find_non_finite_batch,
)
from d2lgpu.runtime.config import smoke_mode
from d2lgpu.runtime.estimate import training_estimate
from d2lgpu.runtime.gpus import as_device

__all__ = [
    "COMPILE_MODES",
    "TECHNIQUES",
    "History",
    "SGDRecipe",
    "Techniques",
    "as_device_loader",
    "compile_model",
    "fused_sgd_device_types",
    "evaluate_accuracy",
    "init_weights",
    "make_sgd",
    "set_seed",
    "technique_skip_reason",
    "train",
    "train_epoch",
    "train_fast",
]

# --------------------------------------------------------------------------- #
# The fast path's switches (chapter 7 teaches them one at a time; train runs them)
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
        check_precision(self.precision, "Techniques.precision")
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
    without its compiler toolchain; a fused SGD this torch lacks for the device type),
    or it buys nothing there: precision "auto" where the device's fast format is fp32,
    and channels-last on a CPU (cuDNN's Tensor Core layout). Fused SGD runs on CPUs too
    where torch lists them (:func:`fused_sgd_device_types`; torch 2.15 does), so the fast
    path uses it there.
    """
    if technique not in TECHNIQUES:
        raise ValueError(f"unknown technique {technique!r}; choose from {TECHNIQUES}")
    device = as_device(device)
    on_cuda = device.type == "cuda"
    if technique == "precision":
        if precision_policy(device, "auto").dtype is not None:
            return None
        if device.type == "cpu":
            return "no native bf16 here: emulated bf16 is slower, 'auto' is fp32"
        return f"no fast reduced format on {device}: 'auto' is fp32"
    if technique == "channels_last" and not on_cuda:
        return "cuDNN's Tensor Core layout; mixed results on CPUs (RESULTS.md)"
    if technique == "fused_optimizer" and device.type not in fused_sgd_device_types():
        return f"this torch has no fused SGD for {device.type}"
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
        elif smoke_mode():
            # Smoke mode checks that full mode's code runs; inductor's C++ build of each
            # graph would cost tens of seconds on a CPU and test no GPU path.
            return "smoke mode on a CPU: inductor's C++ build takes tens of seconds"
    return None


# --------------------------------------------------------------------------- #
# What the switches use
# --------------------------------------------------------------------------- #


def fused_sgd_device_types() -> tuple[str, ...]:
    """The device types whose ``torch.optim.SGD(fused=True)`` this torch runs, as torch lists
    them (``torch.utils._foreach_utils``; torch 2.15 lists CUDA and the CPU); ``()`` without a
    ``fused`` argument."""
    if "fused" not in inspect.signature(torch.optim.SGD).parameters:
        return ()
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # older torch: fused SGD existed for CUDA only
        return ("cuda",)
    return tuple(_get_fused_kernels_supported_devices())


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
    if device.type in fused_sgd_device_types():
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
    if not isinstance(name, str):
        raise TypeError(f"name must be the argument's name (a str, e.g. 'train_data'), "
                        f"got {name!r}")
    device = as_device(device)
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
    check_module("net", net)
    if not isinstance(techniques, Techniques):
        raise TypeError(f"techniques must be a d2lgpu.Techniques (e.g. Techniques(compile=True)), "
                        f"got {type(techniques).__name__} {techniques!r}")
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
        # fullgraph=True: a graph break, or a model past dynamo's recompile limit (8 cache
        # entries per function in torch 2.15), raises instead of running eager code
        # under a compiled label.
        # dynamic=False with CUDA graphs: a graph is recorded per shape (the smaller last
        # batch gets its own). With automatic dynamic shapes torch 2.11's cudagraph trees
        # replayed the batch-64 graph on a batch of 52 and raised a size mismatch (H200).
        graphs = techniques.cuda_graphs
        return torch.compile(net, mode=modes[techniques.compile_mode, graphs],
                             fullgraph=True, dynamic=False if graphs else None)
    if techniques.cuda_graphs:
        return torch.compile(net, backend="cudagraphs", fullgraph=True, dynamic=False)
    return net


#: What :func:`d2lgpu.train` does without being told: loss and accuracy read once per epoch.
PLAIN = Techniques()

def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's RNGs, CUDA included.

    Enough for identical runs on the CPU. On GPUs some kernels (e.g. atomics in
    backward passes) stay non-deterministic unless deterministic algorithms are
    requested, so GPU runs agree closely but not bit for bit.
    """
    check_seed(seed)
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
    except ImportError:  # numpy is optional for this package
        return
    np.random.seed(seed % 2**32)


def init_weights(net: nn.Module) -> None:
    """Re-initialise every parameter and buffer of ``net``: Xavier for conv/linear weights.

    Each module's own ``reset_parameters`` runs first (batch norm: weight 1, bias 0,
    running statistics cleared), then conv and linear weights get Xavier-uniform, as
    in d2l's training loops, and their biases zero. Nothing from an earlier run survives.
    """
    check_module("net", net)
    for module in net.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if isinstance(module, nn.modules.batchnorm._NormBase):
            module.reset_running_stats()
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


@dataclass
class History:
    """What :func:`train` measured, one entry per epoch.

    ``examples_per_second`` counts training examples over the training part of the
    epoch only (evaluation excluded). ``device`` says where it ran, e.g. ``"cuda:0, cuda:1"``.
    """

    train_loss: list[float] = field(default_factory=list)
    train_acc: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    examples_per_second: list[float] = field(default_factory=list)
    device: str = ""

    @property
    def num_epochs(self) -> int:
        return len(self.train_loss)

    def summary(self) -> str:
        """One line: the last epoch's loss and accuracies, and the mean throughput."""
        if not self.train_loss:
            return f"no epochs run on {self.device}"
        speed = sum(self.examples_per_second) / len(self.examples_per_second)
        return (
            f"loss {self.train_loss[-1]:.3f}, train acc {self.train_acc[-1]:.3f}, "
            f"test acc {self.test_acc[-1]:.3f}; {speed:.1f} examples/sec on {self.device}"
        )

    def to_dict(self) -> dict:
        """A plain dict (lists and a string), e.g. for ``json.dump``."""
        return asdict(self)


def _model_device(net: nn.Module) -> torch.device:
    for tensor in net.parameters():
        return tensor.device
    for tensor in net.buffers():
        return tensor.device
    return torch.device("cpu")


def evaluate_accuracy(
    net: nn.Module,
    data_iter: Iterable,
    device: torch.device | str | None = None,
    *,
    policy: PrecisionPolicy | None = None,
) -> float:
    """Fraction of correctly classified examples in ``data_iter`` (batches of ``(X, y)``).

    Runs in eval mode (batch norm uses its running statistics) without gradients, and
    puts the model back in the mode it was in. ``device=None`` means where the model's
    parameters are. ``policy`` runs the forward pass under its autocast.
    """
    check_module("net", net)
    check_loader("data_iter", data_iter)
    device = _model_device(net) if device is None else _one_device("device", device)
    _check_policy(policy, none_ok=True)
    policy = policy or PrecisionPolicy(device.type, None, False)
    was_training = net.training
    net.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    total = 0
    try:
        with torch.no_grad():
            for index, batch in enumerate(data_iter):
                X, y = check_batch("data_iter", batch, index)
                X = X.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                with policy.autocast():
                    y_hat = net(X)
                correct += (y_hat.argmax(dim=1) == y).sum()
                total += y.numel()
    finally:
        net.train(was_training)
    if total == 0:
        raise ValueError("data_iter yielded no examples: cannot compute an accuracy")
    return correct.item() / total


def train_epoch(
    net: nn.Module,
    train_iter: Iterable,
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    policy: PrecisionPolicy,
    scaler: torch.amp.GradScaler,
    scheduler: LinearWarmup | None = None,
    on_batch=None,
    *,
    techniques: Techniques = PLAIN,
    first_step_loss: list[torch.Tensor | float] | None = None,
) -> tuple[float, float, int]:
    """One pass over ``train_iter``; returns (mean loss, accuracy, number of examples).

    When ``first_step_loss`` is an empty list, the first step's loss is appended to it:
    the start that the divergence rule (:func:`d2lgpu.runtime.checks.check_training_loss`)
    measures later losses against. With ``no_sync`` it is a device tensor, not read here.

    With ``techniques.no_sync`` (the default) the sums stay on ``device`` during the
    epoch and are read once at the end, so the GPU is never stalled waiting for the
    host to see a loss value. Without it they are read with ``.item()`` after every
    step, as d2l's loop does: each read waits until the device has finished the step.
    ``scheduler`` is stepped after every batch; ``on_batch()`` is called after every
    batch (progress bars). Each step is a ``train_step`` range in profiler traces.
    """
    check_module("net", net)
    check_loader("train_iter", train_iter)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a loss such as nn.CrossEntropyLoss(), got "
                        f"{type(loss_fn).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer over net's parameters, "
                        f"got {type(optimizer).__name__}")
    device = _one_device("device", device)
    _check_policy(policy, none_ok=False)
    if not (hasattr(scaler, "scale") and hasattr(scaler, "step")):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (policy.make_scaler()), got "
                        f"{type(scaler).__name__}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"scheduler must have a step() method (a LinearWarmup) or be None, "
                        f"got {type(scheduler).__name__} {scheduler!r}")
    if on_batch is not None and not callable(on_batch):
        raise TypeError(f"on_batch must be a function called after each batch, or None, "
                        f"got {type(on_batch).__name__} {on_batch!r}")
    if not isinstance(techniques, Techniques):
        raise TypeError(f"techniques must be a Techniques (e.g. Techniques()), "
                        f"got {type(techniques).__name__} {techniques!r}")
    net.train()
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss_read, correct_read = 0.0, 0  # the per-step host copies when not no_sync
    count = 0
    for index, batch in enumerate(train_iter):
        X, y = check_batch("train_iter", batch, index)
        with torch.profiler.record_function("train_step"):
            X = X.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if techniques.channels_last and X.dim() == 4:
                X = X.contiguous(memory_format=torch.channels_last)  # a no-op when it is
            if techniques.cuda_graphs:
                # Tells the graph replays that the previous step's outputs are done with.
                torch.compiler.cudagraph_mark_step_begin()
            optimizer.zero_grad(set_to_none=True)
            with policy.autocast():
                y_hat = net(X)
                loss = loss_fn(y_hat, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if scheduler is not None:
                scheduler.step()
            if techniques.no_sync:
                loss_sum += loss.detach().float() * y.numel()
                correct += (y_hat.detach().argmax(dim=1) == y).sum()
                if first_step_loss is not None and not first_step_loss:
                    first_step_loss.append(loss.detach().float())  # read once, later
            else:
                # Each .item() makes the host wait until the device has finished the step.
                step_loss = loss.item()
                loss_read += step_loss * y.numel()
                correct_read += (y_hat.argmax(dim=1) == y).sum().item()
                if first_step_loss is not None and not first_step_loss:
                    first_step_loss.append(step_loss)
            count += y.numel()
        if on_batch is not None:
            on_batch()
    if count == 0:
        raise ValueError("train_iter yielded no examples: check the data loader")
    if not techniques.no_sync:
        return loss_read / count, correct_read / count, count
    return loss_sum.item() / count, correct.item() / count, count


class _AutocastForward(nn.Module):
    """Runs ``module`` under ``policy.autocast()``, in whichever thread calls it."""

    def __init__(self, module: nn.Module, policy: PrecisionPolicy) -> None:
        super().__init__()
        self.module = module
        self.policy = policy

    def forward(self, *args, **kwargs):
        with self.policy.autocast():
            return self.module(*args, **kwargs)


class LinearWarmup:
    """Ramps every parameter group's lr linearly up to its value over ``steps`` steps.

    Step ``s`` (0-based) trains with ``lr * (s + 1) / steps``, then ``lr`` on. It sets
    the lr directly instead of through ``torch.optim.lr_scheduler``: with fp16 a
    GradScaler skips the first optimizer steps while it finds its scale, and torch's
    schedulers warn when they step before the optimizer has; ramping on by batch
    count regardless is what is meant here.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"warm-up needs at least 1 step, got {steps}")
        self.optimizer = optimizer
        self.steps = steps
        self.done = 0
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self._apply()

    def _apply(self) -> None:
        factor = min(1.0, (self.done + 1) / self.steps)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def step(self) -> None:
        """Advance by one training step."""
        self.done += 1
        self._apply()


def warmup_scheduler(
    optimizer: torch.optim.Optimizer, warmup_epochs: float, steps_per_epoch: int | None
) -> LinearWarmup | None:
    """The warm-up over ``warmup_epochs`` epochs of ``steps_per_epoch`` batches, or None
    when there is none (shared by :func:`train` and :func:`d2lgpu.train_fast`)."""
    if warmup_epochs == 0:
        return None
    if steps_per_epoch is None:
        raise ValueError("warmup_epochs needs a train_iter with a length (e.g. a DataLoader)")
    return LinearWarmup(optimizer, max(1, math.ceil(warmup_epochs * steps_per_epoch)))


@dataclass(frozen=True)
class SGDRecipe:
    """How :func:`train` optimises: SGD with ``lr``, ``momentum`` and ``weight_decay``,
    the learning rate ramped up linearly over the first ``warmup_epochs`` epochs.

    Pass it where :func:`train` takes ``lr``, e.g.
    ``d2lgpu.train(net, train_iter, test_iter, 10, d2lgpu.SGDRecipe(0.4, warmup_epochs=1))``;
    a plain number is ``SGDRecipe(lr)``. Large batches with a linearly scaled learning
    rate need the warm-up (Goyal et al., 2017).
    """

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    warmup_epochs: float = 0.0

    def __post_init__(self) -> None:
        check_positive_float("lr", self.lr)
        check_finite_float("momentum", self.momentum, minimum=0, below=1)
        check_finite_float("weight_decay", self.weight_decay, minimum=0)
        check_finite_float("warmup_epochs", self.warmup_epochs, minimum=0)

    def make_optimizer(
        self, params: Iterable[nn.Parameter], device: torch.device, *, fused: bool = False
    ) -> torch.optim.SGD:
        """``torch.optim.SGD`` over ``params``; ``fused``: the fastest step on ``device``
        (:func:`d2lgpu.fast.make_sgd`), as the ``fused_optimizer`` technique asks."""
        if fused:
            return make_sgd(params, self.lr, device, momentum=self.momentum,
                            weight_decay=self.weight_decay)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum,
                               weight_decay=self.weight_decay)


def as_recipe(lr: float | SGDRecipe, num_epochs: int) -> SGDRecipe:
    """``lr`` as an :class:`SGDRecipe` (a number is plain SGD), checked against ``num_epochs``."""
    check_positive_int("num_epochs", num_epochs)
    recipe = lr if isinstance(lr, SGDRecipe) else SGDRecipe(lr)
    if recipe.warmup_epochs > num_epochs:
        raise ValueError(
            f"warmup_epochs must be between 0 and num_epochs ({num_epochs}), "
            f"got {recipe.warmup_epochs!r}"
        )
    return recipe


@dataclass(frozen=True)
class StepParts:
    """What every training step of a run uses, built once by :func:`train`.

    ``model`` is what trains (the module itself, its compiled wrapper, or
    ``nn.DataParallel`` around it); ``eval_model`` is what evaluation runs (the eager
    module behind a compiled one). ``scheduler`` is the warm-up, or None.
    """

    model: nn.Module
    eval_model: nn.Module
    loss_fn: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LinearWarmup | None
    policy: PrecisionPolicy
    scaler: torch.amp.GradScaler
    device: torch.device
    techniques: Techniques = PLAIN


def run_epochs(
    parts: StepParts,
    train_iter: Iterable,
    test_iter: Iterable,
    num_epochs: int,
    history: History,
    *,
    bar=None,
    live: LivePlot | None = None,
) -> None:
    """The epoch loop of :func:`train`: train one epoch, evaluate, append to ``history``,
    update the progress ``bar`` and ``live`` plot (either may be None)."""
    estimate = training_estimate(train_iter, num_epochs, parts.device)  # one line, long runs
    first_step_loss: list[torch.Tensor | float] = []
    for epoch in range(num_epochs):
        start = time.perf_counter()
        loss, train_acc, count = train_epoch(
            parts.model, train_iter, parts.loss_fn, parts.optimizer, parts.device,
            parts.policy, parts.scaler, parts.scheduler,
            on_batch=estimate.step if bar is None else lambda: (bar.update(1), estimate.step()),
            techniques=parts.techniques, first_step_loss=first_step_loss,
        )
        train_seconds = time.perf_counter() - start  # train_epoch read its sums: synchronised
        # The run's start: a float already, or (no_sync) read once in the whole run, after
        # the epoch's own reads, so it waits on nothing.
        first = float(first_step_loss[0]) if first_step_loss else None
        check_finite_loss(loss, _epoch_steps(epoch, train_iter),
                          parts.optimizer.defaults["lr"], parts.policy, first_loss=first)
        with torch.profiler.record_function("evaluate"):
            test_acc = evaluate_accuracy(parts.eval_model, test_iter, parts.device,
                                         policy=parts.policy)
        history.train_loss.append(loss)
        history.train_acc.append(train_acc)
        history.test_acc.append(test_acc)
        history.epoch_seconds.append(time.perf_counter() - start)
        history.examples_per_second.append(count / train_seconds)
        if bar is not None:
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}", test_acc=f"{test_acc:.3f}")
        if live is not None:
            live.add(epoch + 1, [loss, train_acc, test_acc])


def _epoch_steps(epoch: int, train_iter: Iterable) -> str:
    """``"epoch 2 (steps 51-100)"``: where an epoch's loss comes from, for error messages."""
    try:
        steps = len(train_iter)  # type: ignore[arg-type]
    except TypeError:
        return f"epoch {epoch + 1}"
    return f"epoch {epoch + 1} (steps {epoch * steps + 1}-{(epoch + 1) * steps})"


def check_finite_loss(
    loss: float, epoch: int | str, lr: float, policy: PrecisionPolicy,
    first_loss: float | None = None,
) -> None:
    """Stop a run whose epoch loss is inf or NaN, or has blown up from ``first_loss``.

    ``epoch`` is the epoch's number, or the words that name it (``"epoch 2 (steps
    51-100)"``); ``first_loss`` is the loss of the run's first step.

    An error, not a warning: once the loss is not a number the weights are too, and
    every further epoch is wasted. Called once per epoch on the loss that
    :func:`train_epoch` has already read, so it costs no extra host synchronisation.
    The check itself is :func:`d2lgpu.runtime.checks.check_training_loss`, shared by every
    function that trains; this adds the advice that fits the precision.
    """
    if policy.dtype == torch.float16:
        other = ("or train in bf16 or fp32 (precision='bf16' or precision='fp32'): fp16 "
                 "overflows above 65504")
    else:
        other = "or ramp it up over the first epoch with lr=d2lgpu.SGDRecipe(lr, warmup_epochs=1)"
    when = epoch if isinstance(epoch, str) else f"epoch {epoch}"
    check_training_loss(loss, when=when, lr=lr, first_loss=first_loss, advice=other)



def _one_device(name: str, device: object) -> torch.device:
    """One device (a torch.device or a string such as 'cuda:0'); a clear error otherwise."""
    if device is None or isinstance(device, (list, tuple)):
        raise TypeError(f"{name} must be one device such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        return as_device(device)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{name}: {err}") from None


def _check_policy(policy: object, *, none_ok: bool) -> None:
    if (policy is None and none_ok) or isinstance(policy, PrecisionPolicy):
        return
    raise TypeError(
        f"policy must be a d2lgpu.PrecisionPolicy (from d2lgpu.precision_policy(device, precision))"
        f"{' or None' if none_ok else ''}, got {type(policy).__name__}"
    )


def _blame_the_data(error: FloatingPointError, train_iter: Iterable) -> None:
    """After a non-finite loss: raise the data's fault instead when a batch of
    ``train_iter`` holds NaN or inf (the learning rate is not the cause then)."""
    try:
        found = find_non_finite_batch("train_iter", train_iter)
    except Exception:  # a one-shot iterator or a loader that fails the second time
        return
    if found is not None:
        raise ValueError(found) from error


def _one_device_techniques(techniques: Techniques) -> list[str]:
    """The switched-on techniques that train on one device only (not with DataParallel)."""
    return [name for name in techniques.enabled if name not in ("no_sync", "precision")]


def _with_precision(techniques: Techniques | None, precision: str | None) -> Techniques:
    """``techniques`` (None: the plain loop) with ``precision`` in place of its own."""
    if techniques is None:
        techniques = PLAIN
    elif not isinstance(techniques, Techniques):
        raise TypeError(
            f"techniques must be a d2lgpu.Techniques, got {type(techniques).__name__}"
        )
    if precision is None:
        return techniques
    return techniques.replace(precision=check_precision(precision))


def _train_devices(
    devices: torch.device | str | Sequence[torch.device | str] | None, techniques: Techniques
) -> list[torch.device]:
    """The devices :func:`train` runs on: one GPU (or the CPU) when a technique needs one."""
    one_device = _one_device_techniques(techniques)
    if devices is None and one_device:
        return [try_gpu()]
    devices = resolve_devices(devices)
    if len(devices) > 1 and one_device:
        raise ValueError(
            f"{', '.join(one_device)} train on one device, got "
            f"{[str(d) for d in devices]}: pass one, e.g. devices=d2lgpu.try_gpu()"
        )
    return devices


def _check_data(
    train_iter: Iterable, test_iter: Iterable, techniques: Techniques, device: torch.device
) -> tuple[Iterable, Iterable]:
    """The loaders, checked against the ``device_data`` switch: DeviceLoaders on
    ``device`` with it, anything but a DeviceLoader without it."""
    if techniques.device_data:
        return (as_device_loader(train_iter, "train_iter", device),
                as_device_loader(test_iter, "test_iter", device))
    for name, data in (("train_iter", train_iter), ("test_iter", test_iter)):
        if isinstance(data, DeviceLoader):
            raise ValueError(
                f"{name} is a DeviceLoader, whose data already lives on {data.device}, "
                "but the device_data switch is off: pass "
                "techniques=d2lgpu.Techniques.fast(device) (or Techniques(device_data=True))"
            )
    return train_iter, test_iter


def _prepare_model(
    net: nn.Module, train_iter: Iterable, device: torch.device, techniques: Techniques, *,
    seed: int | None, init: bool,
) -> None:
    """Seed, re-initialise (or check the kept weights) and move ``net`` to ``device``."""
    if seed is not None:
        set_seed(seed)
        if isinstance(train_iter, DeviceLoader):
            train_iter.manual_seed(seed)  # its own generator: restart its shuffling too
    if init:
        init_weights(net)
    else:
        check_finite_tensors(
            "the model's weights (init=False keeps them)", net.parameters(),
            fix="Pass init=True to start from fresh weights, or load a checkpoint saved "
            "before the run that produced them.",
        )
    if techniques.channels_last:
        net.to(device, memory_format=torch.channels_last)
    else:
        net.to(device)


def _step_parts(
    net: nn.Module, devices: list[torch.device], recipe: SGDRecipe, techniques: Techniques,
    steps_per_epoch: int | None,
) -> StepParts:
    """The model wrapper, optimizer, warm-up and precision policy of a run of :func:`train`."""
    device = devices[0]
    policy = precision_policy(device, techniques.precision)
    model = compile_model(net, techniques, device)
    if len(devices) > 1:
        # DataParallel's replica threads re-enter autocast with the default dtype
        # (fp16 on CUDA), not ours: entering the policy inside forward keeps bf16 bf16.
        inner = _AutocastForward(net, policy) if policy.dtype is not None else net
        model = nn.DataParallel(inner, device_ids=devices)
    optimizer = recipe.make_optimizer(net.parameters(), device,
                                      fused=techniques.fused_optimizer)
    compiled = techniques.compile or techniques.cuda_graphs
    return StepParts(
        model=model, eval_model=net if compiled else model, loss_fn=nn.CrossEntropyLoss(),
        optimizer=optimizer,
        scheduler=warmup_scheduler(optimizer, recipe.warmup_epochs, steps_per_epoch),
        policy=policy, scaler=policy.make_scaler(), device=device, techniques=techniques,
    )


@contextlib.contextmanager
def _cudnn_benchmark(enabled: bool) -> Iterator[None]:
    """cuDNN's autotuner on while the body runs (when ``enabled``); restored after."""
    before = torch.backends.cudnn.benchmark
    if enabled:
        torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def _progress_bar(show: bool, total: int | None, desc: str):
    """A tqdm bar of ``total`` batches, or None when ``show`` is False."""
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="batch")


def _live_plot(plot: bool | None, num_epochs: int) -> LivePlot | None:
    """The live plot of loss and accuracies per epoch (``plot=None``: in a notebook only)."""
    if not (plot or (plot is None and in_notebook())):
        return None
    return LivePlot(
        xlabel="epoch", legend=["train loss", "train acc", "test acc"],
        xlim=(1, num_epochs) if num_epochs > 1 else None,
    )


def train(
    net: nn.Module,
    train_iter: Iterable,
    test_iter: Iterable,
    num_epochs: int,
    lr: float | SGDRecipe,
    devices: torch.device | str | Sequence[torch.device | str] | None = None,
    *,
    seed: int | None = None,
    precision: str | None = None,
    techniques: Techniques | None = None,
    progress: bool = True,
    plot: bool | None = None,
    init: bool = True,
) -> History:
    """Train a classifier with SGD and cross-entropy; evaluate on ``test_iter`` every epoch.

    ``lr``: the learning rate, or an :class:`SGDRecipe` (momentum, weight decay, a
    warm-up). ``devices``: None for all GPUs (the CPU without GPUs), one device, or a
    list; more than one CUDA device wraps the model in ``nn.DataParallel``, which
    splits every batch across them. ``seed`` seeds everything first (initialisation,
    shuffling), so the same seed gives the same history on the CPU. ``init=False``
    keeps the model's weights (fine-tuning; otherwise every parameter is reset).
    ``progress`` shows a tqdm bar; ``plot`` a live plot (None: only inside a
    notebook). The model is trained in place and stays on ``devices[0]``.

    ``precision``: a word of :data:`d2lgpu.precision.PRECISIONS` ("auto", "fp32", "tf32", "fp16",
    "bf16", see :func:`d2lgpu.precision_policy`); None means ``techniques.precision``
    ("fp32" for the plain loop). ``techniques`` (a :class:`d2lgpu.Techniques`; default
    ``Techniques()``) switches on the fast path's techniques one by one;
    ``Techniques.fast(device)`` is the whole fast path. With ``device_data`` the data
    must be :class:`d2lgpu.DeviceLoader` s on the device; without it a DeviceLoader
    is refused, so the switch always says where the data was. Every technique but
    ``no_sync`` and ``precision`` needs one device; ``devices=None`` then means
    :func:`d2lgpu.try_gpu`. With ``compile`` or ``cuda_graphs`` evaluation runs the
    eager module, and the first epoch's time includes compiling.

    Before training, the data loaders, switches and (with ``init=False``) the weights
    are checked. A loss that turns NaN or inf stops the run: the error blames the
    data when a training batch holds NaN or inf, and the learning rate otherwise.
    """
    check_module("net", net)
    check_loader("train_iter", train_iter)
    check_loader("test_iter", test_iter)
    recipe = as_recipe(lr, num_epochs)
    check_bool("progress", progress)
    check_bool("init", init)
    check_bool("plot", plot, none_means="plot only inside a notebook")
    techniques = _with_precision(techniques, precision)
    devices = _train_devices(devices, techniques)
    device = devices[0]
    train_iter, test_iter = _check_data(train_iter, test_iter, techniques, device)
    _prepare_model(net, train_iter, device, techniques, seed=seed, init=init)
    steps_per_epoch = len(train_iter) if hasattr(train_iter, "__len__") else None
    parts = _step_parts(net, devices, recipe, techniques, steps_per_epoch)

    history = History(device=", ".join(str(d) for d in devices))
    extras = "" if techniques == PLAIN else f" ({techniques}; {parts.policy.name})"
    bar = _progress_bar(progress, None if steps_per_epoch is None else
                        steps_per_epoch * num_epochs, f"training on {history.device}{extras}")
    live = _live_plot(plot, num_epochs)
    # With channels-last, cuDNN's autotuner picks the fastest convolution (the NHWC
    # Tensor Core kernels) once per input shape; a fixed batch size pays that off at once.
    autotune = techniques.channels_last and device.type == "cuda"
    try:
        with parts.policy.matmul_precision(), _cudnn_benchmark(autotune):
            run_epochs(parts, train_iter, test_iter, num_epochs, history, bar=bar, live=live)
    except FloatingPointError as error:
        _blame_the_data(error, train_iter)
        raise
    finally:
        if bar is not None:
            bar.close()
        if live is not None:
            live.close()
    return history


def train_fast(
    net: nn.Module,
    train_data: DeviceLoader | tuple[torch.Tensor, torch.Tensor],
    test_data: DeviceLoader | tuple[torch.Tensor, torch.Tensor],
    num_epochs: int,
    lr: float | SGDRecipe,
    device: torch.device | str | None = None,
    *,
    batch_size: int = 256,
    seed: int | None = 0,
    precision: str | None = None,
    techniques: Techniques | None = None,
    progress: bool = True,
    init: bool = True,
) -> History:
    """:func:`train` on one device with the fast path's techniques; the same :class:`History`.

    ``train_data``/``test_data``: :class:`d2lgpu.DeviceLoader` s (e.g. from
    :func:`d2lgpu.fashion_mnist_on_device`), or pairs ``(uint8 images, labels)`` that
    are put on the device here and batched with ``batch_size`` (train shuffled).
    ``seed`` seeds initialisation and restarts the training loader's shuffling, so a
    seed gives the same run on the CPU (GPU kernels may differ in the last bits).
    ``techniques``: None means :meth:`d2lgpu.Techniques.fast` on ``device`` (precision
    "auto": the device's fast format; channels-last and a fused optimizer on CUDA);
    ``Techniques.fast(device, compile=True)`` adds ``torch.compile``, whose first
    epoch then includes compilation. It must keep ``device_data`` on. ``precision``
    (None: the techniques') overrides the techniques' precision.
    ``epoch_seconds`` include evaluation, ``examples_per_second`` count training only.
    """
    recipe = as_recipe(lr, num_epochs)  # checked before the data are copied
    check_positive_int("batch_size", batch_size)
    # One device only; resolve_devices names the GPU ("cuda" -> "cuda:0") and gives a
    # clear error for one that is not there.
    devices = [try_gpu()] if device is None else resolve_devices(device)
    if len(devices) != 1:
        raise ValueError(f"train_fast trains on one device, got {[str(d) for d in devices]}")
    device = devices[0]
    techniques = Techniques.fast(device) if techniques is None else techniques
    if not isinstance(techniques, Techniques) or not techniques.device_data:
        raise ValueError(
            f"train_fast keeps the data on the device: techniques must be a d2lgpu.Techniques "
            f"with device_data=True, e.g. Techniques.fast(device, compile=True), got "
            f"{techniques!r}. For DataLoaders use d2lgpu.train."
        )
    train_loader = as_device_loader(
        train_data, "train_data", device, batch_size=batch_size, shuffle=True, seed=seed or 0,
        channels_last=techniques.channels_last,
    )
    test_loader = as_device_loader(
        test_data, "test_data", device, batch_size=batch_size,
        channels_last=techniques.channels_last,
    )
    return train(
        net, train_loader, test_loader, num_epochs, recipe, device, seed=seed, precision=precision,
        techniques=techniques, progress=progress, plot=False, init=init,
    )
