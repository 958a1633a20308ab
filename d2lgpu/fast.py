"""Chapter 7's fast path: the techniques that fill one device, by the names the chapter uses.

:func:`d2lgpu.train` is the loop most learners start from: a CPU ``DataLoader``
decodes and copies every batch, and the GPU waits whenever the host falls behind.
For a data set as small as Fashion-MNIST (47 MB as uint8) that is pure overhead.
The fastest small-image training code (e.g. the CIFAR-10 speed runs) removes it
technique by technique, and :class:`Techniques` names each one as a switch of
:func:`train_fast`. Chapter 7 writes each one out in plain PyTorch, then turns them
on one at a time in an ablation (:func:`d2lgpu.profiling.run_ablation`):

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
    Model and batches in NHWC, the layout of cuDNN's Tensor Core convolutions; on CUDA
    it also turns cuDNN's autotuner on (``torch.backends.cudnn.benchmark``): two changes.
``fused_optimizer``
    One fused SGD kernel updates all parameters (:func:`make_sgd`); it also takes
    GradScaler's inf check on the device, so fp16 needs no host round trip either.
``compile``
    ``torch.compile`` fuses the model's operations into fewer, generated kernels
    (costs seconds to minutes up front and needs a compiler toolchain).
``cuda_graphs``
    The model's kernels are recorded once as a CUDA graph and replayed, one launch
    per graph instead of one per kernel (:func:`compile_model`).

:meth:`Techniques.fast` is the fast path: every technique that pays off on the
device (:func:`technique_skip_reason` says why one does not), with ``compile`` and
``cuda_graphs`` to be asked for.

:func:`train_fast` trains with them; it reuses chapter 4's :class:`d2lgpu.History`,
:func:`d2lgpu.evaluate_accuracy` and the divergence check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from d2lgpu.data import DeviceLoader
from d2lgpu.devices import try_gpu
from d2lgpu.precision import PrecisionPolicy, check_precision, precision_policy
from d2lgpu.runtime.checks import (
    check_batch,
    check_bool,
    check_finite_float,
    check_loader,
    check_module,
    check_positive_float,
    check_positive_int,
    check_sequence,
)
from d2lgpu.runtime.config import smoke_mode
from d2lgpu.runtime.gpus import as_device, resolve_devices
from d2lgpu.training import History, check_epoch_loss, evaluate_accuracy, progress_bar, start_run

__all__ = [
    "COMPILE_MODES",
    "SWITCHES",
    "TECHNIQUES",
    "Techniques",
    "as_device_loader",
    "compile_model",
    "fast_epoch",
    "fused_sgd_device_types",
    "make_sgd",
    "technique_skip_reason",
    "train_fast",
]

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
    """Which speed techniques :func:`train_fast` uses: one switch per technique (chapter 7).

    ``Techniques()`` is chapter 4's loop, :func:`d2lgpu.train` (``no_sync`` only, in
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
    characters), or None when it uses it (chapter 7).

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



# --------------------------------------------------------------------------- #
# The loop that runs the switches
# --------------------------------------------------------------------------- #


def fast_epoch(
    model: nn.Module, train_iter: Iterable, optimizer: torch.optim.Optimizer,
    device: torch.device, policy: PrecisionPolicy, scaler: torch.amp.GradScaler,
    techniques: Techniques, on_batch=None,
) -> tuple[float, float, int, float]:
    """Chapter 4's :func:`d2lgpu.train_epoch` with the switches of ``techniques`` (chapter 7):
    the same four numbers back. ``policy`` and ``scaler`` are the precision's autocast and
    loss scaling. With ``no_sync`` the sums stay on the device and are read once; without
    it they are read with ``.item()`` after every step, as d2l's loop does, and every read
    waits for the device. Each step is a ``train_step`` range in profiler traces."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    loss_read, correct_read, count, first_loss = 0.0, 0, 0, None
    for index, batch in enumerate(train_iter):
        X, y = check_batch("train_iter", batch, index)
        with torch.profiler.record_function("train_step"):
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if techniques.channels_last and X.dim() == 4:
                X = X.contiguous(memory_format=torch.channels_last)  # a no-op when it is
            if techniques.cuda_graphs:  # the previous step's graph outputs are done with
                torch.compiler.cudagraph_mark_step_begin()
            optimizer.zero_grad(set_to_none=True)
            with policy.autocast():
                y_hat = model(X)
                loss = nn.functional.cross_entropy(y_hat, y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if techniques.no_sync:
                step_loss = loss.detach().float()
                loss_sum += step_loss * len(y)
                correct += (y_hat.detach().argmax(dim=1) == y).sum()
            else:  # each .item() waits until the device has finished the step
                step_loss = loss.item()
                loss_read += step_loss * len(y)
                correct_read += (y_hat.argmax(dim=1) == y).sum().item()
            first_loss = step_loss if first_loss is None else first_loss
            count += len(y)
        if on_batch is not None:
            on_batch()
    if count == 0:
        raise ValueError("train_iter yielded no examples: check the data loader")
    if techniques.no_sync:
        loss_read, correct_read = loss_sum.item(), correct.item()
    return loss_read / count, correct_read / count, count, float(first_loss)


@contextlib.contextmanager
def _cudnn_benchmark(enabled: bool) -> Iterator[None]:
    """cuDNN's autotuner on while the body runs (when ``enabled``); restored after."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = before or enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def _fast_loaders(
    train_data: object, test_data: object, techniques: Techniques, device: torch.device,
    batch_size: int, seed: int | None,
) -> tuple[Iterable, Iterable]:
    """The loaders ``train_fast`` reads: DeviceLoaders on ``device`` with ``device_data``
    (tensor pairs are put there now), anything but a DeviceLoader without it."""
    if techniques.device_data:
        kwargs = dict(batch_size=batch_size, channels_last=techniques.channels_last)
        return (as_device_loader(train_data, "train_data", device, shuffle=True,
                                 seed=seed or 0, **kwargs),
                as_device_loader(test_data, "test_data", device, **kwargs))
    for name, data in (("train_data", train_data), ("test_data", test_data)):
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(
                isinstance(t, torch.Tensor) for t in data):
            raise TypeError(
                f"{name} is a pair of tensors, which train_fast puts on the device only with "
                "the device_data switch: pass techniques=d2lgpu.Techniques.fast(device), or "
                "DataLoaders without it")
        if isinstance(data, DeviceLoader):
            raise ValueError(
                f"{name} is a DeviceLoader, whose data already lives on {data.device}, but "
                "the device_data switch is off: pass techniques=d2lgpu.Techniques.fast(device) "
                "(or Techniques(device_data=True))")
        check_loader(name, data)
    return train_data, test_data


def _fast_parts(
    net: nn.Module, techniques: Techniques, device: torch.device, lr: float,
) -> tuple[nn.Module, torch.optim.Optimizer, PrecisionPolicy, torch.amp.GradScaler]:
    """``net`` on ``device`` as the switches ask (layout, compiled or not), its optimizer,
    and the precision policy with its loss scaler."""
    layout = torch.channels_last if techniques.channels_last else torch.preserve_format
    net.to(device, memory_format=layout)
    policy = precision_policy(device, techniques.precision)
    model = compile_model(net, techniques, device)
    optimizer = (make_sgd(net.parameters(), lr, device) if techniques.fused_optimizer
                 else torch.optim.SGD(net.parameters(), lr=lr))
    return model, optimizer, policy, policy.make_scaler()


def train_fast(
    net: nn.Module,
    train_data: object,
    test_data: object,
    num_epochs: int,
    lr: float,
    device: torch.device | str | None = None,
    *,
    techniques: Techniques | None = None,
    batch_size: int = 256,
    seed: int | None = 0,
    precision: str | None = None,
    progress: bool = True,
    init: bool = True,
) -> History:
    """Chapter 7's fast path: chapter 4's :func:`d2lgpu.train` on one device, with the switches
    of ``techniques`` (None: :meth:`Techniques.fast` on ``device``; None: :func:`d2lgpu.try_gpu`).

    With ``device_data`` the data are :class:`d2lgpu.DeviceLoader` s, or pairs (uint8
    images, labels) put on the device here in batches of ``batch_size``; without it,
    DataLoaders (or lists of batches). ``precision`` (None: the techniques' word) overrides
    ``techniques.precision``. With ``compile`` or ``cuda_graphs`` the first epoch includes
    compiling, and evaluation runs the eager module. ``seed`` seeds the weights and the
    shuffling; ``init=False`` keeps the weights. The same :class:`d2lgpu.History` back.
    """
    check_module("net", net)
    check_positive_int("num_epochs", num_epochs)
    check_positive_float("lr", lr)
    check_positive_int("batch_size", batch_size)
    check_bool("progress", progress)
    check_bool("init", init)
    # resolve_devices names the GPU ("cuda" -> "cuda:0") and explains a missing one
    devices = [try_gpu()] if device is None else resolve_devices(device, "train_fast")
    if len(devices) != 1:
        raise ValueError(f"train_fast trains on one device, got {[str(d) for d in devices]}")
    device = devices[0]
    if techniques is None:
        techniques = Techniques.fast(device)
    if not isinstance(techniques, Techniques):
        raise TypeError(f"techniques must be a d2lgpu.Techniques (e.g. Techniques.fast(device)),"
                        f" got {type(techniques).__name__} {techniques!r}")
    if precision is not None:
        techniques = techniques.replace(precision=check_precision(precision))
    train_iter, test_iter = _fast_loaders(train_data, test_data, techniques, device,
                                          batch_size, seed)
    start_run(net, seed, init)
    if seed is not None and isinstance(train_iter, DeviceLoader):
        train_iter.manual_seed(seed)  # its own generator: restart its shuffling too
    model, optimizer, policy, scaler = _fast_parts(net, techniques, device, lr)
    # fp16 overflows above 65504: the divergence message says so
    advice = "or train in bf16 (precision='bf16')" if policy.dtype == torch.float16 else ""
    history = History(device=str(device))
    steps = len(train_iter) if hasattr(train_iter, "__len__") else None
    bar = progress_bar(progress, steps and steps * num_epochs,
                       f"training on {device} ({techniques}; {policy.name})")
    # With channels-last, cuDNN's autotuner picks the fastest convolution (the NHWC Tensor
    # Core kernels) once per input shape; a fixed batch size pays that off at once.
    autotune = techniques.channels_last and device.type == "cuda"
    try:
        with policy.matmul_precision(), _cudnn_benchmark(autotune):
            for epoch in range(num_epochs):
                start = time.perf_counter()
                loss, train_acc, count, first_loss = fast_epoch(
                    model, train_iter, optimizer, device, policy, scaler, techniques,
                    on_batch=lambda: bar.update(1))
                train_seconds = time.perf_counter() - start  # fast_epoch read its sums
                check_epoch_loss(loss, epoch, steps, lr, first_loss, train_iter, advice)
                with torch.profiler.record_function("evaluate"), policy.autocast():
                    test_acc = evaluate_accuracy(net, test_iter, device)
                history.add(loss, train_acc, test_acc, time.perf_counter() - start,
                            count / train_seconds)
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}", test_acc=f"{test_acc:.3f}")
    finally:
        bar.close()
    return history
