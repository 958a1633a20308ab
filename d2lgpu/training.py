"""Chapter 4's training loop: d2l's ``train_ch13``, made safe to run anywhere and reproducible.

Chapter 4 writes the loop in a cell (``nn.DataParallel`` over the GPUs, SGD, cross-entropy,
one evaluation per epoch) and then checks that :func:`train` gives the same numbers. What
:func:`train` adds to that cell:

* ``devices=None`` means :func:`d2lgpu.try_all_gpus`, which is ``[cpu]`` without a GPU, so the
  loop never indexes an empty list (d2l raises ``IndexError`` there).
* Every parameter and batch-norm statistic is re-initialised under ``seed`` at the start, so a
  model object reused for a second run does not silently continue from the first.
* Loss and correct counts are summed on the device and read once per epoch, instead of making
  the host wait for the device after every batch.
* A loss that turns NaN or inf, or grows ten times past where it started, stops the run with a
  message that names the epoch and the fix (NaN in the data is blamed on the data).
* A tqdm bar with the time left (its ETA).

Chapter 7's fast path (:func:`d2lgpu.train_fast`) reuses :class:`History`,
:func:`evaluate_accuracy` and :func:`set_seed`/:func:`init_weights` from here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from d2lgpu.runtime.checks import (
    check_batch,
    check_bool,
    check_finite_tensors,
    check_loader,
    check_module,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_training_loss,
    find_non_finite_batch,
)
from d2lgpu.runtime.gpus import resolve_devices

__all__ = [
    "History", "check_epoch_loss", "evaluate_accuracy", "init_weights", "progress_bar",
    "set_seed", "start_run", "train", "train_epoch",
]


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's RNGs, CUDA included (chapter 4).

    Enough for identical runs on the CPU. On GPUs some kernels (e.g. atomics in backward
    passes) stay non-deterministic unless deterministic algorithms are requested, so GPU
    runs agree closely but not bit for bit.
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
    """Re-initialise every parameter and buffer of ``net`` (chapter 4): each module's own
    ``reset_parameters`` (batch norm: weight 1, bias 0, running statistics cleared), then
    Xavier-uniform conv and linear weights and zero biases, as in d2l's training loops."""
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
    """What :func:`train` measured, one entry per epoch (chapter 4).

    ``examples_per_second`` counts training examples over the training part of the epoch
    only (evaluation excluded). ``device`` says where it ran, e.g. ``"cuda:0, cuda:1"``.
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

    def add(self, train_loss: float, train_acc: float, test_acc: float, epoch_seconds: float,
            examples_per_second: float) -> None:
        """Append one epoch's numbers."""
        for name, value in locals().items():
            if name != "self":
                getattr(self, name).append(value)

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


def evaluate_accuracy(net: nn.Module, data_iter: Iterable, device: torch.device) -> float:
    """Fraction of correctly classified examples in ``data_iter`` (batches ``(X, y)``), in
    eval mode and without gradients (chapter 4); ``net`` goes back to the mode it was in."""
    was_training = net.training
    net.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    total = 0
    try:
        with torch.no_grad():
            for index, batch in enumerate(data_iter):
                X, y = check_batch("data_iter", batch, index)
                X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
                correct += (net(X).argmax(dim=1) == y).sum()
                total += y.numel()
    finally:
        net.train(was_training)
    if total == 0:
        raise ValueError("data_iter yielded no examples: cannot compute an accuracy")
    return correct.item() / total


def train_epoch(
    model: nn.Module, train_iter: Iterable, optimizer: torch.optim.Optimizer,
    device: torch.device, on_batch=None,
) -> tuple[float, float, int, float]:
    """One pass over ``train_iter`` with cross-entropy (chapter 4). Returns the mean loss,
    the accuracy, the number of examples and the first step's loss (where the run started,
    for the divergence rule). Sums stay on ``device`` and are read once, at the end."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    first_loss, count = None, 0
    for index, batch in enumerate(train_iter):
        X, y = check_batch("train_iter", batch, index)
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad()
        y_hat = model(X)
        loss = nn.functional.cross_entropy(y_hat, y)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(y)  # summed on the device: no wait per step
        correct += (y_hat.argmax(dim=1) == y).sum()
        count += len(y)
        first_loss = loss.detach() if first_loss is None else first_loss
        if on_batch is not None:
            on_batch()
    if count == 0:
        raise ValueError("train_iter yielded no examples: check the data loader")
    return loss_sum.item() / count, correct.item() / count, count, first_loss.item()


def start_run(net: nn.Module, seed: int | None, init: bool) -> None:
    """Seed everything (``seed`` not None), then give ``net`` fresh weights, or with
    ``init=False`` check that the weights it keeps are finite (chapter 4)."""
    if seed is not None:
        set_seed(seed)
    if init:
        init_weights(net)
    else:
        check_finite_tensors("the model's weights (init=False keeps them)", net.parameters(),
                             fix="Pass init=True to start from fresh weights.")


def progress_bar(show: bool, total: int | None, desc: str) -> tqdm:
    """A tqdm bar of ``total`` batches with the time left, or a silent one (``show=False``)."""
    if not show:  # tqdm.auto, imported in a notebook, looks for ipywidgets: only when shown
        return tqdm(total=total, disable=True)
    from tqdm.auto import tqdm as notebook_or_text_bar

    return notebook_or_text_bar(total=total, desc=desc, unit="batch")


def check_epoch_loss(
    loss: float, epoch: int, steps: int | None, lr: float, first_loss: float,
    train_iter: Iterable, advice: str = "",
) -> None:
    """Stop a run whose epoch loss broke the divergence rule (chapter 4): a FloatingPointError
    naming the epoch, its steps and the lr, or a ValueError when a batch of ``train_iter``
    holds NaN or inf (then the data are at fault, not the learning rate)."""
    when = f"epoch {epoch + 1}"
    if steps is not None:
        when += f" (steps {epoch * steps + 1}-{(epoch + 1) * steps})"
    try:
        check_training_loss(loss, when=when, lr=lr, first_loss=first_loss, advice=advice)
    except FloatingPointError as error:
        found = find_non_finite_batch("train_iter", train_iter)
        if found is not None:
            raise ValueError(found) from error
        raise


def train(
    net: nn.Module,
    train_iter: Iterable,
    test_iter: Iterable,
    num_epochs: int,
    lr: float,
    devices: torch.device | str | Sequence[torch.device | str] | None = None,
    *,
    seed: int | None = None,
    progress: bool = True,
    init: bool = True,
) -> History:
    """Train a classifier with SGD and cross-entropy, evaluating on ``test_iter`` every epoch:
    chapter 4's loop. ``devices``: None for all GPUs (the CPU without one), one device, or a
    list; several GPUs wrap the model in ``nn.DataParallel``. ``seed`` seeds the weights and
    the shuffling; ``init=False`` keeps the weights. ``progress``: a tqdm bar with the time left.
    ``net`` is trained in place, on ``devices[0]``; :func:`d2lgpu.plot_history` draws the
    returned :class:`History`."""
    check_module("net", net)
    check_loader("train_iter", train_iter)
    check_loader("test_iter", test_iter)
    check_positive_int("num_epochs", num_epochs)
    check_positive_float("lr", lr)
    check_bool("progress", progress)
    check_bool("init", init)
    devices = resolve_devices(devices)
    start_run(net, seed, init)
    net.to(devices[0])
    model = nn.DataParallel(net, device_ids=devices) if len(devices) > 1 else net
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    history = History(device=", ".join(str(d) for d in devices))
    steps = len(train_iter) if hasattr(train_iter, "__len__") else None
    bar = progress_bar(progress, steps and steps * num_epochs, f"training on {history.device}")
    try:
        for epoch in range(num_epochs):
            start = time.perf_counter()
            loss, train_acc, count, first_loss = train_epoch(
                model, train_iter, optimizer, devices[0], on_batch=lambda: bar.update(1))
            train_seconds = time.perf_counter() - start
            check_epoch_loss(loss, epoch, steps, lr, first_loss, train_iter)
            test_acc = evaluate_accuracy(model, test_iter, devices[0])
            history.add(loss, train_acc, test_acc, time.perf_counter() - start,
                        count / train_seconds)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}", test_acc=f"{test_acc:.3f}")
    finally:
        bar.close()
    return history
