"""Training and evaluation loops for image classifiers on the CPU, one GPU or all GPUs.

:func:`train` is d2l's ``train_ch13`` made safe to run anywhere and reproducible:

* ``devices=None`` means :func:`d2lgpu.try_all_gpus`, which is ``[cpu]`` without a
  GPU, so the loop never indexes an empty list (d2l raises ``IndexError`` there).
* Every parameter and batch-norm statistic is re-initialised under ``seed`` at the
  start, so a model object reused for a second run does not silently continue from
  the first (d2l re-initialises only the conv and linear weights).
* Loss and correct counts accumulate on the device and are read once per epoch,
  instead of forcing a host-device synchronisation on every batch.
* ``warmup_epochs`` ramps the learning rate up linearly, which large batches with a
  linearly scaled learning rate need (Goyal et al., 2017).

The body of one epoch is :func:`train_epoch`, so that other training paths can reuse
it or replace it without copying the set-up in :func:`train`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from d2lgpu.checks import check_seed
from d2lgpu.devices import as_device, num_gpus, try_all_gpus, try_gpu
from d2lgpu.estimate import training_estimate
from d2lgpu.plotting import LivePlot, in_notebook
from d2lgpu.precision import PrecisionPolicy, precision_policy

__all__ = [
    "History",
    "evaluate_accuracy",
    "init_weights",
    "resolve_devices",
    "set_seed",
    "train",
    "train_epoch",
]


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


def resolve_devices(
    devices: torch.device | str | Sequence[torch.device | str] | None,
) -> list[torch.device]:
    """Turn ``devices`` into a non-empty list of distinct devices that :func:`train` can use.

    ``None`` means all GPUs, or the CPU without GPUs. Several CPU devices, or CPU mixed
    with GPUs, are an error: ``nn.DataParallel`` splits batches across CUDA devices only.
    """
    if devices is None:
        return try_all_gpus()
    if isinstance(devices, (str, torch.device, int)):
        devices = [devices]
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
                f"train cannot use {d.type!r} devices: pass 'cpu', 'cuda', 'cuda:1', a list "
                "of CUDA devices, or None for all GPUs (the CPU without GPUs)"
            )
    visible = num_gpus()
    for d in resolved:
        if d.type == "cuda" and (d.index or 0) >= visible:
            raise ValueError(
                f"{d} is not available: this process sees {visible} GPU(s). "
                "Pass devices=None (d2lgpu.try_all_gpus()) to use whatever is there."
            )
    if resolved[0].type == "cuda" and resolved[0].index is None:
        resolved[0] = torch.device("cuda", torch.cuda.current_device())
    if len(resolved) > 1:
        if any(d.type != "cuda" for d in resolved):
            raise ValueError(
                f"cannot train on {[str(d) for d in resolved]}: data parallelism here needs CUDA "
                "devices only. Use one CPU device (devices=[d2lgpu.cpu()]), or see chapter 3 "
                "for splitting a batch by hand with d2lgpu.split_batch."
            )
        if any(d.index is None for d in resolved):
            raise ValueError("name each GPU with its index when passing several, e.g. 'cuda:1'")
        if len({d.index for d in resolved}) != len(resolved):
            raise ValueError(f"devices repeats a GPU: {[str(d) for d in resolved]}")
    return resolved


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
    device = _model_device(net) if device is None else torch.device(device)
    policy = policy or PrecisionPolicy(device.type, None, False)
    was_training = net.training
    net.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    total = 0
    try:
        with torch.no_grad():
            for X, y in data_iter:
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
) -> tuple[float, float, int]:
    """One pass over ``train_iter``; returns (mean loss, accuracy, number of examples).

    The sums stay on ``device`` during the epoch and are read once at the end, so the
    GPU is never stalled waiting for the host to see a loss value. ``scheduler`` is
    stepped after every batch; ``on_batch()`` is called after every batch (progress bars).
    """
    net.train()
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    for X, y in train_iter:
        X = X.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            y_hat = net(X)
            loss = loss_fn(y_hat, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if scheduler is not None:
            scheduler.step()
        loss_sum += loss.detach().float() * y.numel()
        correct += (y_hat.detach().argmax(dim=1) == y).sum()
        count += y.numel()
        if on_batch is not None:
            on_batch()
    if count == 0:
        raise ValueError("train_iter yielded no examples: check the data loader")
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


def run_epochs(
    model: nn.Module,
    train_iter: Iterable,
    test_iter: Iterable,
    num_epochs: int,
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    policy: PrecisionPolicy,
    scaler: torch.amp.GradScaler,
    scheduler: LinearWarmup | None,
    history: History,
    bar=None,
    live: LivePlot | None = None,
) -> None:
    """The epoch loop shared by :func:`train` and :func:`d2lgpu.train_fast`: train one
    epoch, evaluate, append to ``history``, update the progress bar and live plot."""
    estimate = training_estimate(train_iter, num_epochs, device)  # one line, for long runs
    for epoch in range(num_epochs):
        start = time.perf_counter()
        loss, train_acc, count = train_epoch(
            model, train_iter, loss_fn, optimizer, device, policy, scaler, scheduler,
            on_batch=estimate.step if bar is None else lambda: (bar.update(1), estimate.step()),
        )
        train_seconds = time.perf_counter() - start  # train_epoch read its sums: synchronised
        check_finite_loss(loss, epoch + 1, optimizer.defaults["lr"], policy)
        test_acc = evaluate_accuracy(model, test_iter, device, policy=policy)
        history.train_loss.append(loss)
        history.train_acc.append(train_acc)
        history.test_acc.append(test_acc)
        history.epoch_seconds.append(time.perf_counter() - start)
        history.examples_per_second.append(count / train_seconds)
        if bar is not None:
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}", test_acc=f"{test_acc:.3f}")
        if live is not None:
            live.add(epoch + 1, [loss, train_acc, test_acc])


def check_finite_loss(loss: float, epoch: int, lr: float, policy: PrecisionPolicy) -> None:
    """Stop a run whose epoch loss is inf or NaN, saying when and what to change.

    An error, not a warning: once the loss is not a number the weights are too, and
    every further epoch is wasted. Called once per epoch on the loss that
    :func:`train_epoch` has already read, so it costs no extra host synchronisation.
    """
    if math.isfinite(loss):
        return
    if policy.dtype == torch.float16:
        other = "or train in bf16 or fp32 (amp='bf16' or amp=False): fp16 overflows above 65504"
    else:
        other = "or ramp it up over the first epoch with warmup_epochs=1"
    raise FloatingPointError(
        f"the training loss became {loss} in epoch {epoch}: training diverged. Try a "
        f"smaller lr (this run: {lr:g}), {other}."
    )


def check_hyperparameters(
    num_epochs: int, lr: float, weight_decay: float, momentum: float, warmup_epochs: float
) -> None:
    """Reject training hyperparameters that cannot be meant, with the accepted range."""
    if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1:
        raise ValueError(f"num_epochs must be an int >= 1, got {num_epochs!r}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be at least 0 and below 1, got {momentum!r}")
    if not 0 <= warmup_epochs <= num_epochs:
        raise ValueError(f"warmup_epochs must be between 0 and num_epochs, got {warmup_epochs!r}")


def train(
    net: nn.Module,
    train_iter: Iterable,
    test_iter: Iterable,
    num_epochs: int,
    lr: float,
    devices: torch.device | str | Sequence[torch.device | str] | None = None,
    *,
    seed: int | None = None,
    amp: bool | str | torch.dtype = False,
    progress: bool = True,
    plot: bool | None = None,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    warmup_epochs: float = 0.0,
    init: bool = True,
    fast: bool = False,
) -> History:
    """Train a classifier with SGD and cross-entropy; evaluate on ``test_iter`` every epoch.

    ``devices``: None for all GPUs (the CPU without GPUs), one device, or a list; more
    than one CUDA device wraps the model in ``nn.DataParallel``, which splits every
    batch across them. ``seed`` seeds everything first (initialisation, shuffling),
    so the same seed gives the same history on the CPU. ``init=False`` keeps the
    model's current weights (fine-tuning; otherwise every parameter is reset).
    ``amp`` picks mixed precision through :func:`d2lgpu.precision_policy`.
    ``warmup_epochs`` ramps the learning rate linearly from ``lr / steps`` to ``lr``
    over that many epochs. ``progress`` shows a tqdm bar; ``plot`` a live plot (None:
    only inside a notebook). The model is trained in place and stays on ``devices[0]``.
    ``fast=True`` hands over to :func:`d2lgpu.train_fast` (one device, data on it:
    ``train_iter``/``test_iter`` from :func:`d2lgpu.fashion_mnist_on_device`; pass
    ``amp="auto"`` for the GPU's fast precision).
    """
    if fast:
        from d2lgpu.fast import train_fast  # imported here: d2lgpu.fast builds on this module

        if plot:
            raise ValueError(
                "plot=True is not available with fast=True: plot the returned History "
                "with d2lgpu.plot_history"
            )
        fast_devices = [try_gpu()] if devices is None else resolve_devices(devices)
        if len(fast_devices) > 1:
            raise ValueError(
                f"fast=True trains on one device, got {[str(d) for d in fast_devices]}: "
                "pass one, e.g. devices=d2lgpu.try_gpu()"
            )
        return train_fast(
            net, train_iter, test_iter, num_epochs, lr, fast_devices[0], seed=seed, amp=amp,
            progress=progress, weight_decay=weight_decay, momentum=momentum,
            warmup_epochs=warmup_epochs, init=init,
        )
    check_hyperparameters(num_epochs, lr, weight_decay, momentum, warmup_epochs)
    devices = resolve_devices(devices)
    device = devices[0]

    if seed is not None:
        set_seed(seed)
    if init:
        init_weights(net)
    net.to(device)
    policy = precision_policy(device, amp)
    model = net
    if len(devices) > 1:
        # DataParallel's replica threads re-enter autocast with the default dtype
        # (fp16 on CUDA), not ours: entering the policy inside forward keeps bf16 bf16.
        inner = _AutocastForward(net, policy) if policy.dtype is not None else net
        model = nn.DataParallel(inner, device_ids=devices)

    scaler = policy.make_scaler()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(
        net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay
    )
    steps_per_epoch = len(train_iter) if hasattr(train_iter, "__len__") else None
    scheduler = warmup_scheduler(optimizer, warmup_epochs, steps_per_epoch)

    history = History(device=", ".join(str(d) for d in devices))
    live = None
    if plot or (plot is None and in_notebook()):
        live = LivePlot(
            xlabel="epoch", legend=["train loss", "train acc", "test acc"],
            xlim=(1, num_epochs) if num_epochs > 1 else None,
        )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = steps_per_epoch * num_epochs if steps_per_epoch is not None else None
        bar = tqdm(total=total, desc=f"training on {history.device}", unit="batch")
    try:
        run_epochs(
            model, train_iter, test_iter, num_epochs, loss_fn, optimizer, device, policy,
            scaler, scheduler, history, bar, live,
        )
    finally:
        if bar is not None:
            bar.close()
        if live is not None:
            live.close()
    return history
