"""Chapter 7's fast path: :class:`Techniques`, one switch per technique that fills one device,
and :func:`train_fast`, chapter 4's loop with those switches."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from d2lgpu.precision import PrecisionPolicy, check_precision, precision_policy
from d2lgpu.runtime import checks
from d2lgpu.runtime.config import smoke_mode
from d2lgpu.runtime.gpus import as_device, require_cuda_device
from d2lgpu.training import (
    History,
    check_epoch_loss,
    evaluate_accuracy,
    init_weights,
    progress_bar,
    set_seed,
)

__all__ = [
    "TECHNIQUES", "Techniques", "compile_model", "fast_epoch", "fused_sgd_device_types",
    "make_sgd", "technique_skip_reason", "train_fast",
]

#: The techniques of the fast path, in the order chapter 7's ablation adds them.
TECHNIQUES = (
    "device_data", "no_sync", "precision", "channels_last", "fused_optimizer", "compile",
    "cuda_graphs",
)


@dataclass(frozen=True)
class Techniques:
    """Which techniques :func:`train_fast` uses, one switch each (chapter 7): ``Techniques()``
    is chapter 4's loop (``no_sync`` only), :meth:`d2l_style` none, :meth:`fast` the fast path."""

    device_data: bool = False  # the data set lives on the device as uint8 (DeviceLoader)
    no_sync: bool = True  # loss and accuracy summed on the device, read once an epoch
    precision: str = "fp32"  # a word of PRECISIONS; "auto": autocast in the device's format
    channels_last: bool = False  # NHWC model and batches (and cuDNN's autotuner on CUDA)
    fused_optimizer: bool = False  # one fused SGD kernel for every parameter (make_sgd)
    compile: bool = False  # torch.compile's generated kernels (seconds to minutes up front)
    cuda_graphs: bool = False  # the model's kernels recorded once and replayed

    def __post_init__(self) -> None:
        check_precision(self.precision, "Techniques.precision")
        for name in TECHNIQUES:
            if name != "precision":
                checks.check_bool(f"Techniques.{name}", getattr(self, name))

    @classmethod
    def d2l_style(cls) -> Techniques:
        """None of them: d2l's loop, which reads loss and accuracy after every step."""
        return cls(no_sync=False)

    @classmethod
    def fast(
        cls, device: torch.device | str, *, compile: bool = False, cuda_graphs: bool = False
    ) -> Techniques:
        """The fast path on ``device``: every technique up to the fused optimizer that pays off
        there (:func:`technique_skip_reason` says why one does not), plus ``compile`` and
        ``cuda_graphs`` when asked for."""
        device = as_device(device)
        auto = precision_policy(device, "auto").dtype is not None  # a fast reduced format
        return cls(device_data=True, precision="auto" if auto else "fp32",
                   channels_last=device.type == "cuda",
                   fused_optimizer=device.type in fused_sgd_device_types(),
                   compile=compile, cuda_graphs=cuda_graphs)

    def __str__(self) -> str:
        names = [f"precision {self.precision}" if name == "precision" else name
                 for name in TECHNIQUES if getattr(self, name) not in (False, "fp32")]
        return " + ".join(names) if names else "none (d2l-style)"


def _has_cxx_compiler() -> bool:
    names = ("cl",) if sys.platform == "win32" else ("c++", "g++", "clang++")
    return any(shutil.which(name) for name in names)


def technique_skip_reason(technique: str, device: torch.device | str) -> str | None:
    """Why the fast path leaves ``technique`` out on ``device`` (it cannot run or buys nothing
    there), in at most 64 characters, or None when it uses it (chapter 7)."""
    if technique not in TECHNIQUES:
        raise ValueError(f"unknown technique {technique!r}; choose from {TECHNIQUES}")
    device = as_device(device)
    on_cuda = device.type == "cuda"
    # The first five: why Techniques.fast leaves one out; the last two: whether they can run.
    if technique == "precision" and Techniques.fast(device).precision == "fp32":
        if device.type == "cpu":
            return "no native bf16 here: emulated bf16 is slower, 'auto' is fp32"
        return f"no fast reduced format on {device}: 'auto' is fp32"
    if technique == "channels_last" and not Techniques.fast(device).channels_last:
        return "cuDNN's Tensor Core layout; mixed results on CPUs (RESULTS.md)"
    if technique == "fused_optimizer" and not Techniques.fast(device).fused_optimizer:
        return f"this torch has no fused SGD for {device.type}"
    if technique == "cuda_graphs" and not on_cuda:
        return "CUDA graphs replay CUDA kernels; a CPU runs none"
    if technique == "compile":
        if not torch._dynamo.is_dynamo_supported():
            return "torch.compile does not support this Python and torch"
        if on_cuda:
            from torch.utils._triton import has_triton

            # Triton needs sm70+ (torch's GPUTooOldForTriton); below it has_triton() is
            # False even with triton installed, so ask the GPU first.
            major, minor = torch.cuda.get_device_capability(device)
            if torch.version.hip is None and major < 7:
                return f"this GPU (sm{major}{minor}) is too old for Triton: it needs sm70+"
            if not has_triton():
                return "torch.compile on a GPU needs Triton (pip install triton)"
        elif not _has_cxx_compiler():
            return "torch.compile on a CPU needs a C++ compiler (g++ or clang++)"
        elif smoke_mode():  # smoke mode checks full mode's code runs, not inductor's C++
            return "smoke mode on a CPU: inductor's C++ build takes tens of seconds"
    return None


def fused_sgd_device_types() -> tuple[str, ...]:
    """The device types whose fused SGD this torch runs (CUDA and the CPU in torch 2.15)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return tuple(_get_fused_kernels_supported_devices())


def make_sgd(params, lr: float, device: torch.device | str) -> torch.optim.SGD:
    """SGD with the fastest step this torch has on ``device`` (chapter 7): ``fused``, one pass
    over every parameter, else ``foreach``, a few multi-tensor kernels."""
    if params is None:
        raise TypeError("params must be the parameters to optimize, e.g. net.parameters()")
    lr = checks.check_positive_float("lr", lr)
    if as_device(device).type in fused_sgd_device_types():
        return torch.optim.SGD(params, lr=lr, fused=True)
    return torch.optim.SGD(params, lr=lr, foreach=True)


def compile_model(net: nn.Module, techniques: Techniques, device: torch.device | str) -> nn.Module:
    """``net``, or a ``torch.compile`` wrapper sharing its weights, as ``techniques`` asks
    (chapter 7): inductor for ``compile`` ("reduce-overhead" with ``cuda_graphs`` too), the
    "cudagraphs" backend for ``cuda_graphs`` alone."""
    checks.check_module("net", net)
    _check_techniques(techniques)
    device = as_device(device)
    if techniques.cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True cannot run on {device}: CUDA graphs replay CUDA "
                         "kernels. Switch it off, or train on a GPU")
    if techniques.compile and device.type == "cpu":
        # Inductor's C++ backend warns that it found no CUDA runtime: true, and irrelevant.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # fullgraph=True: a graph break, or dynamo's recompile limit, raises instead of running
    # eager code under a compiled label. dynamic=False with CUDA graphs: a graph per shape
    # (torch 2.11's cudagraph trees replayed a batch-64 graph on a batch of 52, H200).
    graphs = techniques.cuda_graphs
    if techniques.compile:
        return torch.compile(net, mode="reduce-overhead" if graphs else None, fullgraph=True,
                             dynamic=False if graphs else None)
    if graphs:
        return torch.compile(net, backend="cudagraphs", fullgraph=True, dynamic=False)
    return net


def fast_epoch(
    model: nn.Module, train_iter: Iterable, optimizer: torch.optim.Optimizer,
    device: torch.device, policy: PrecisionPolicy, scaler: torch.amp.GradScaler,
    techniques: Techniques, bar: tqdm,
) -> tuple[float, float, int, float]:
    """Chapter 4's :func:`d2lgpu.train_epoch` with the switches of ``techniques`` (chapter 7);
    each step is a ``train_step`` range in traces."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    first_loss, count = None, 0
    for X, y in train_iter:
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
                loss_sum += loss.detach().float() * len(y)
                correct += (y_hat.detach().argmax(dim=1) == y).sum()
            else:  # d2l's loop: each .item() waits until the device has finished the step
                loss_sum += loss.item() * len(y)
                correct += (y_hat.argmax(dim=1) == y).sum().item()
            first_loss = loss.detach() if first_loss is None else first_loss
            count += len(y)
        bar.update(1)
    if count == 0:  # an iterator without a length passes check_loader even when it is empty
        raise ValueError("train_iter gave no batches: train_fast needs a non-empty training set")
    return loss_sum.item() / count, correct.item() / count, count, first_loss.item()


def _check_techniques(techniques: object) -> None:
    if not isinstance(techniques, Techniques):
        raise TypeError(f"techniques must be a d2lgpu.Techniques (e.g. Techniques.fast(device)), "
                        f"got {techniques!r}")


def _check_inputs(device: torch.device, techniques: object, train_iter: object,
                  test_iter: object) -> None:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"train_fast cannot use {device.type!r} devices: pass 'cpu' or 'cuda:0'")
    _check_techniques(techniques)
    for name, loader in (("train_iter", train_iter), ("test_iter", test_iter)):
        if techniques.device_data and isinstance(loader, torch.utils.data.DataLoader):
            raise TypeError(
                f"{name} is a DataLoader, but the device_data switch is on: pass loaders that "
                "hold the data on the device, d2lgpu.fashion_mnist_on_device(batch_size, device), "
                "or switch it off (e.g. techniques=d2lgpu.Techniques())")
        checks.check_loader(name, loader)


def _model_and_optimizer(
    net: nn.Module, techniques: Techniques, device: torch.device, lr: float
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``net`` moved to ``device`` in the techniques' layout, the model to call (compiled or
    not) and the SGD that updates ``net``'s weights (fused or not)."""
    net.to(device, memory_format=torch.channels_last if techniques.channels_last
           else torch.preserve_format)
    optimizer = (make_sgd(net.parameters(), lr, device) if techniques.fused_optimizer
                 else torch.optim.SGD(net.parameters(), lr=lr))
    return compile_model(net, techniques, device), optimizer


def train_fast(
    net: nn.Module, train_iter: Iterable, test_iter: Iterable, num_epochs: int, lr: float,
    device: torch.device | str, *, techniques: Techniques | None = None, seed: int | None = 0,
    progress: bool = True,
) -> History:
    """Chapter 4's :func:`d2lgpu.train` on one ``device`` with the switches of ``techniques``
    (None: :meth:`Techniques.fast`) (chapter 7); with ``device_data`` the loaders hold the data
    there (:func:`d2lgpu.fashion_mnist_on_device`)."""
    checks.check_module("net", net)
    checks.check_positive_int("num_epochs", num_epochs)
    checks.check_positive_float("lr", lr)
    checks.check_bool("progress", progress)
    device = require_cuda_device(device, "train_fast")
    techniques = Techniques.fast(device) if techniques is None else techniques
    _check_inputs(device, techniques, train_iter, test_iter)
    if seed is not None:
        set_seed(seed)
        if hasattr(train_iter, "manual_seed"):  # a DeviceLoader shuffles with its own generator
            train_iter.manual_seed(seed)
    init_weights(net)  # fresh weights, as chapter 4's train starts
    model, optimizer = _model_and_optimizer(net, techniques, device, lr)
    policy = precision_policy(device, techniques.precision)
    scaler = policy.make_scaler()
    # fp16 overflows above 65504: the divergence message says so
    advice = "or train in bf16 (precision='bf16')" if policy.dtype == torch.float16 else ""
    history = History(device=str(device))
    steps = len(train_iter) if hasattr(train_iter, "__len__") else None
    bar = progress_bar(progress, steps and steps * num_epochs,
                       f"training on {device} ({techniques}; {policy.name})")
    # cuDNN's autotuner picks the NHWC Tensor Core convolutions once per input shape.
    autotune = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = autotune or techniques.channels_last and device.type == "cuda"
    try:
        with policy.matmul_precision():
            for epoch in range(num_epochs):
                start = time.perf_counter()
                loss, train_acc, count, first_loss = fast_epoch(
                    model, train_iter, optimizer, device, policy, scaler, techniques, bar)
                train_seconds = time.perf_counter() - start  # fast_epoch read its sums
                check_epoch_loss(loss, epoch, steps, lr, first_loss, train_iter, advice)
                with torch.profiler.record_function("evaluate"), policy.autocast():
                    test_acc = evaluate_accuracy(net, test_iter, device)
                history.add(loss, train_acc, test_acc, time.perf_counter() - start,
                            count / train_seconds)
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}", test_acc=f"{test_acc:.3f}")
    finally:
        torch.backends.cudnn.benchmark = autotune
        bar.close()
    return history
