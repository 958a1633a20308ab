"""Chapter 4's training loop, :func:`train`: d2l's ``train_ch13`` with a seed, a fresh start,
sums kept on the device and a stop with the fix when the loss diverges. Chapter 7's fast path
(:func:`d2lgpu.train_fast`) reuses its parts."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from d2lgpu.devices import resolve_devices
from d2lgpu.runtime.checks import (
    check_finite_tensors,
    check_loader,
    check_positive_float,
    check_training_loss,
    find_non_finite_batch,
)

__all__ = [
    "History", "check_epoch_loss", "evaluate_accuracy", "init_weights", "progress_bar",
    "set_seed", "start_run", "train", "train_epoch",
]


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's and torch's RNGs, CUDA included (chapter 4)."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def init_weights(net: nn.Module) -> None:
    """Fresh weights, as d2l's loops start (chapter 4): ``reset_parameters`` everywhere (batch
    norm's running statistics too), Xavier-uniform conv and linear weights, zero biases."""
    for module in net.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


@dataclass
class History:
    """What :func:`train` measured per epoch (chapter 4); speeds exclude the evaluation."""

    train_loss: list[float] = field(default_factory=list)
    train_acc: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    examples_per_second: list[float] = field(default_factory=list)
    device: str = ""

    @property
    def num_epochs(self) -> int:
        return len(self.train_loss)

    def add(self, train_loss: float, train_acc: float, test_acc: float, epoch_seconds: float,
            examples_per_second: float) -> None:
        for name, value in locals().items():
            if name != "self":
                getattr(self, name).append(value)


def evaluate_accuracy(net: nn.Module, data_iter: Iterable, device: torch.device) -> float:
    """The fraction of ``data_iter`` that ``net`` classifies right, in eval mode (chapter 4)."""
    net.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    total = 0
    with torch.no_grad():
        for X, y in data_iter:
            X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
            correct += (net(X).argmax(dim=1) == y).sum()
            total += y.numel()
    if total == 0:  # an iterator without a length passes check_loader even when it is empty
        raise ValueError("data_iter gave no examples: evaluate_accuracy needs a non-empty test set")
    return correct.item() / total


def train_epoch(model: nn.Module, train_iter: Iterable, optimizer: torch.optim.Optimizer,
                device: torch.device, bar: tqdm) -> tuple[float, float, int, float]:
    """One pass (chapter 4): mean loss, accuracy, examples and first loss, read once at the end."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    first_loss, count = None, 0
    for X, y in train_iter:
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad()
        y_hat = model(X)
        loss = nn.functional.cross_entropy(y_hat, y)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(y)
        correct += (y_hat.argmax(dim=1) == y).sum()
        count += len(y)
        first_loss = loss.detach() if first_loss is None else first_loss
        bar.update(1)
    return loss_sum.item() / count, correct.item() / count, count, first_loss.item()


def start_run(net: nn.Module, seed: int | None, init: bool) -> None:
    """Seed (unless None), then fresh weights, or with ``init=False`` check the kept are finite."""
    if seed is not None:
        set_seed(seed)
    if init:
        init_weights(net)
    else:
        check_finite_tensors("the model's weights (init=False keeps them)", net.parameters(),
                             fix="Pass init=True to start from fresh weights.")


def progress_bar(show: bool, total: int | None, desc: str) -> tqdm:
    """A tqdm bar of ``total`` batches with the time left, or a silent one."""
    if not show:  # tqdm.auto looks for ipywidgets: only when a bar is shown
        return tqdm(total=total, disable=True)
    from tqdm.auto import tqdm as auto_tqdm

    return auto_tqdm(total=total, desc=desc, unit="batch")


def check_epoch_loss(loss: float, epoch: int, steps: int | None, lr: float, first_loss: float,
                     train_iter: Iterable, advice: str = "") -> None:
    """Stop a diverged run (chapter 4), blaming the data when a batch holds NaN or inf."""
    when = f"epoch {epoch + 1}" + (f" (steps {epoch * steps + 1}-{(epoch + 1) * steps})"
                                   if steps is not None else "")
    try:
        check_training_loss(loss, when=when, lr=lr, first_loss=first_loss, advice=advice)
    except FloatingPointError as error:
        found = find_non_finite_batch("train_iter", train_iter)
        if found is not None:
            raise ValueError(found) from error
        raise


def train(net: nn.Module, train_iter: Iterable, test_iter: Iterable, num_epochs: int, lr: float,
          devices: torch.device | str | Sequence[torch.device | str] | None = None, *,
          seed: int | None = None, progress: bool = True, init: bool = True) -> History:
    """SGD with cross-entropy, tested every epoch (chapter 4). ``devices``: None for all GPUs
    (else the CPU), one device or a list (``nn.DataParallel``); ``init=False`` keeps weights."""
    check_positive_float("lr", lr)
    check_loader("train_iter", train_iter)
    check_loader("test_iter", test_iter)
    devices = resolve_devices(devices)
    start_run(net, seed, init)
    net.to(devices[0])
    model = nn.DataParallel(net, device_ids=devices) if len(devices) > 1 else net
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    history = History(device=", ".join(str(d) for d in devices))
    steps = len(train_iter)
    bar = progress_bar(progress, steps * num_epochs, f"training on {history.device}")
    for epoch in range(num_epochs):
        start = time.perf_counter()
        loss, train_acc, count, first = train_epoch(model, train_iter, optimizer, devices[0], bar)
        train_seconds = time.perf_counter() - start
        check_epoch_loss(loss, epoch, steps, lr, first, train_iter,
                         "" if init else "or init=True if the weights kept were broken")
        test_acc = evaluate_accuracy(model, test_iter, devices[0])
        history.add(loss, train_acc, test_acc, time.perf_counter() - start, count / train_seconds)
        bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}", test_acc=f"{test_acc:.3f}")
    bar.close()
    return history
