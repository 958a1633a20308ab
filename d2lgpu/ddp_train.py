"""Train on Fashion-MNIST with DistributedDataParallel: the torchrun entry point of chapter 5::

    torchrun --standalone --nproc_per_node=2 -m d2lgpu.ddp_train --epochs 2

With ``--checkpoint-dir``, a distributed checkpoint (d2lgpu.runtime.checkpoints) is written
after every epoch, and a restarted job (``torchrun --max-restarts=N``) continues from the
newest one.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from d2lgpu.devices import try_gpu
from d2lgpu.precision import PRECISIONS, PrecisionPolicy, check_precision, precision_policy
from d2lgpu.runtime.checkpoints import CheckpointError, Checkpoints
from d2lgpu.runtime.checks import (
    check_bool,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_training_loss,
)
from d2lgpu.runtime.cli import add_job_flags, add_training_flags, check_checkpoint_flags
from d2lgpu.runtime.config import small_data
from d2lgpu.runtime.distributed import (
    DEFAULT_TIMEOUT_S,
    CollectiveTimeout,
    DistContext,
    all_reduce_sum,
    end_process,
    exit_status_of,
    mark_progress,
    process_group,
)
from d2lgpu.training import History

__all__ = [
    "MODELS", "DDPConfig", "DDPResult", "build_model", "command_line", "ddp_worker", "main",
    "strip_batchnorm", "train_ddp",
]

#: ``small_cnn_nobn`` has no batch norm, which normalises with the *local* batch's
#: statistics: without it DDP matches one process on the whole batch to rounding error.
MODELS = ("resnet18", "small_cnn", "small_cnn_nobn")

#: (train images, train labels, test images, test labels).
Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class DDPConfig:
    """The settings of a run (chapter 5); the command line's flags of the same names set them."""

    epochs: int = 2
    batch_size: int = 256  # global, split evenly over the ranks (the data-parallel replicas)
    lr: float = 0.1
    seed: int = 0  # the shuffle's; the callers below seed the weights with it too
    log: bool = True  # rank 0 prints one line per epoch
    #: A word of d2lgpu.precision.PRECISIONS; "fp32" is strict (TF32 off), so that DDP can
    #: be compared with one process to 1e-5.
    precision: str = "fp32"

    def __post_init__(self) -> None:
        check_positive_int("epochs", self.epochs)
        check_positive_int("batch_size", self.batch_size)
        check_positive_float("lr", self.lr)
        check_seed(self.seed)
        check_bool("log", self.log)
        check_precision(self.precision)


@dataclass
class DDPResult(History):
    """The :class:`~d2lgpu.training.History` of a run (epochs before a restart included),
    plus what only a DDP job has; ``state_dict`` is the final model on the CPU."""

    world_size: int = 1
    backend: str = "none"  # "none": one process without a process group
    resumed_from_epoch: int = 0
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)


def strip_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every batch-norm layer of ``module`` by ``nn.Identity``, in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(module, name, nn.Identity())
        else:
            strip_batchnorm(child)
    return module


def build_model(name: str) -> nn.Module:
    """A fresh model of :data:`MODELS` for 28x28 grey images and 10 classes (chapter 5)."""
    from d2lgpu.models import resnet18, small_cnn

    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    if name == "resnet18":
        return resnet18()
    return small_cnn() if name == "small_cnn" else strip_batchnorm(small_cnn())


# --- Training ---
def _check_inputs(model: object, data: object, batch_size: int, world_size: int) -> None:
    """A model; (train images, train labels, test images, test labels), finite; and a global
    batch that the ranks split evenly."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (e.g. build_model('small_cnn')), got "
                        f"{type(model).__name__}")
    if not (isinstance(data, (tuple, list)) and len(data) == 4
            and all(isinstance(t, torch.Tensor) for t in data)):
        raise TypeError("data must be a tuple of 4 tensors (train images, train labels, test "
                        f"images, test labels), got {type(data).__name__}")
    for name, images, labels in (("train", data[0], data[1]), ("test", data[2], data[3])):
        if len(images) == 0 or len(images) != len(labels) or labels.is_floating_point():
            raise ValueError(f"the {name} set needs images (one per rank at least) and an "
                             f"integer class label each, got {len(images)} images and "
                             f"{len(labels)} labels of {labels.dtype}")
        if images.is_floating_point() and not torch.isfinite(images).all():
            raise ValueError(f"the {name} images hold nan or inf: clean the data before training")
    if batch_size % world_size:
        raise ValueError(f"batch_size={batch_size} is the global batch and must be divisible "
                         f"by the {world_size} ranks: use a multiple of {world_size}")


def _make_loaders(
    cfg: DDPConfig, data: Tensors4, rank: int, world_size: int
) -> tuple[DistributedSampler, DataLoader, DataLoader]:
    """This rank's sampler and loaders: its slice of every epoch's shuffle, and of the test
    set (uint8 pixels scaled to [0, 1])."""
    images = [x.float() / 255 if x.dtype == torch.uint8 else x.float() for x in data[::2]]
    train_set = TensorDataset(images[0], data[1])
    # Every world_size-th test example, no padding: the summed counts are the test set.
    test_set = Subset(TensorDataset(images[1], data[3]), range(rank, len(data[3]), world_size))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed)
    local_batch = cfg.batch_size // world_size
    return (sampler, DataLoader(train_set, batch_size=local_batch, sampler=sampler),
            DataLoader(test_set, batch_size=local_batch))


def _epoch(
    net: nn.Module, loader: DataLoader, device: torch.device, policy: PrecisionPolicy,
    optimizer: torch.optim.Optimizer | None = None, scaler: torch.amp.GradScaler | None = None,
) -> tuple[float, float, int, float]:
    """One pass over this rank's batches, training when given an ``optimizer``: (summed loss,
    correct, examples, first loss), read from the device once, at the end."""
    loss_fn = nn.CrossEntropyLoss()
    net.train(optimizer is not None)
    loss_sum, correct = torch.zeros((), device=device), torch.zeros((), device=device)
    first_loss, seen = None, 0
    with torch.set_grad_enabled(optimizer is not None):
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            with policy.autocast():
                logits = net(X)
                loss = loss_fn(logits.float(), y)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
                # The gradients arrive averaged over the ranks: every rank's scaler skips alike.
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            first_loss = loss.detach().clone() if first_loss is None else first_loss
            loss_sum += loss.detach() * len(y)
            correct += (logits.argmax(dim=1) == y).sum()
            seen += len(y)
    return loss_sum.item(), correct.item(), seen, first_loss.item()


def train_ddp(cfg: DDPConfig, ctx: DistContext | None, data: Tensors4, model: nn.Module,
              device: torch.device | None = None, hooks: Any = None) -> DDPResult:
    """Train ``model``, in place, on ``data`` with DDP inside the process group ``ctx``
    (chapter 5); ``ctx=None`` trains in this one process, the baseline DDP must reproduce (seed
    torch alike before building both models). ``hooks``: the command line's resume,
    checkpoints and crash on purpose (``_EntryHooks``)."""
    world_size, rank = (ctx.world_size, ctx.rank) if ctx is not None else (1, 0)
    _check_inputs(model, data, cfg.batch_size, world_size)
    device = device or (ctx.device if ctx is not None else torch.device("cpu"))
    sampler, train_loader, test_loader = _make_loaders(cfg, data, rank, world_size)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    policy = precision_policy(device, cfg.precision)
    scaler = policy.make_scaler()
    result = DDPResult(world_size=world_size, backend=ctx.backend if ctx else "none",
                       device=str(device))
    start_loss = hooks.restore(result, model, optimizer, scaler, ctx) if hooks else None
    # DDP copies rank 0's weights to all ranks; its hooks all-reduce gradients during backward.
    net = model if ctx is None else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    steps = len(train_loader)
    with policy.matmul_precision():  # TF32 on or off, as the precision says (CUDA only)
        for epoch in range(result.num_epochs, cfg.epochs):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, identical on all ranks
            mark_progress(f"epoch {epoch + 1} started")  # named if a peer times out waiting
            started = time.perf_counter()
            stats = [*_epoch(net, train_loader, device, policy, optimizer, scaler),
                     *_epoch(net, test_loader, device, policy)]
            if ctx is not None:
                stats = all_reduce_sum(stats, ctx)  # whole-job totals on every rank
            loss_sum, correct, seen, first_loss, _, test_correct, test_seen, _ = stats
            if start_loss is None:
                start_loss = first_loss / world_size  # the mean of the ranks' first batches
            # Judged on totals every rank shares: all stop together, before any checkpoint.
            check_training_loss(loss_sum / seen, lr=cfg.lr, first_loss=start_loss,
                                when=f"epoch {epoch + 1} (steps {epoch * steps + 1}-"
                                f"{(epoch + 1) * steps})")
            seconds = time.perf_counter() - started
            result.add(loss_sum / seen, correct / seen, test_correct / test_seen, seconds,
                       seen / seconds)
            if rank == 0 and cfg.log:
                print(f"epoch {epoch + 1}/{cfg.epochs}: loss {loss_sum / seen:.3f}, train acc "
                      f"{correct / seen:.3f}, test acc {test_correct / test_seen:.3f}, "
                      f"{seconds:.1f} s, {seen / seconds:.0f} examples/s ({world_size} rank(s), "
                      f"{ctx.backend if ctx else 'no process group'})", flush=True)
            if hooks:
                hooks.after_epoch(result, start_loss, model, optimizer, scaler, ctx)
    result.state_dict = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return result


def ddp_worker(
    rank: int, world_size: int, master_port: int, cfg: DDPConfig, model_name: str,
    data: Tensors4, timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DDPResult:
    """What :func:`d2lgpu.runtime.distributed.launch` runs: join the group, build the model
    of :data:`MODELS` named ``model_name`` from ``cfg.seed``, train, leave (chapter 5)."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=timeout_s) as ctx:
        torch.manual_seed(cfg.seed)
        return train_ddp(cfg, ctx, data, build_model(model_name))


# --- The command line ---
_HISTORY = ("train_loss", "train_acc", "test_acc", "epoch_seconds", "examples_per_second")


@dataclass
class _EntryHooks(Checkpoints):
    """The runtime's checkpoint hooks as the command line runs :func:`train_ddp`: a checkpoint
    after every epoch (a step here) holding the history too, which a resumed run takes back,
    and a crash of the last rank after epoch ``fail_after_epoch``, on the first attempt only."""

    epochs: int = 1
    fail_after_epoch: int | None = None

    def restore(self, result: DDPResult, model: nn.Module, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler, ctx: DistContext | None) -> float | None:
        resumed = self.resume(model, optimizer, scaler, {}, end=self.epochs)
        if resumed.path is None:
            return None
        for key in _HISTORY:
            getattr(result, key).extend(resumed.extra["history"][key])
        result.resumed_from_epoch = resumed.step
        if ctx is None or ctx.is_main:
            print(f"resuming from {resumed.path} after epoch {resumed.step}", flush=True)
        return resumed.extra["start_loss"]

    def after_epoch(self, result: DDPResult, start_loss: float, model: nn.Module,
                    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    ctx: DistContext | None) -> None:
        done = result.num_epochs
        extra = {"history": {key: getattr(result, key) for key in _HISTORY},
                 "start_loss": start_loss}
        self.after_step(done, model, optimizer, scaler, {}, self.epochs, extra)  # every rank
        rank, last = (ctx.rank, ctx.world_size - 1) if ctx else (0, 0)
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if self.fail_after_epoch == done and rank == last and not restarted:
            raise RuntimeError(f"simulated failure of rank {rank} after epoch {done} "
                               "(--fail-after-epoch)")


def _parse_args(argv: Sequence[str] | None) -> tuple[DDPConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m d2lgpu.ddp_train",
                                     description=__doc__.split("::")[0])
    add_training_flags(parser, epochs=DDPConfig.epochs, batch_size=DDPConfig.batch_size,
                       lr=DDPConfig.lr, seed=DDPConfig.seed, precisions=PRECISIONS,
                       precision=DDPConfig.precision, lr_help="SGD's learning rate",
                       checkpoint_help="resume from the newest checkpoint here, and write one "
                       "after every epoch")
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="default: small_cnn in quick mode, resnet18 otherwise")
    add_job_flags(parser, crash_point="this epoch's checkpoint")
    args = parser.parse_args(argv)
    check_checkpoint_flags(parser, args, args.epochs)
    args.quick = small_data() if args.quick is None else args.quick
    args.model = args.model or ("small_cnn" if args.quick else "resnet18")
    return DDPConfig(args.epochs, args.batch_size, args.lr, args.seed,
                     precision=args.precision), args


def main(argv: Sequence[str] | None = None) -> DDPResult:
    """Command line: under torchrun every process joins the group; run directly, it trains alone."""
    from d2lgpu.data import fashion_mnist_tensors

    cfg, args = _parse_args(argv)
    # The settings a resumed run must repeat, by their flags.
    config = {"--model": args.model, "--batch-size": cfg.batch_size, "--lr": cfg.lr,
              "--seed": cfg.seed, "--precision": cfg.precision, "--quick": args.quick}
    hooks = _EntryHooks(args.checkpoint_dir, config=config, epochs=cfg.epochs,
                        fail_after_epoch=args.fail_after_epoch)
    data = (*fashion_mnist_tensors(train=True, root=args.data_root, quick=args.quick),
            *fashion_mnist_tensors(train=False, root=args.data_root, quick=args.quick))
    torch.manual_seed(cfg.seed)  # the same initial weights in every process
    model = build_model(args.model)
    if "RANK" not in os.environ:
        device = try_gpu()
        print(f"not started by torchrun: training in this one process on {device}, "
              "without a process group")
        return train_ddp(cfg, None, data, model, device, hooks)
    with process_group(timeout_s=args.timeout) as ctx:
        if ctx.is_main:
            print(f"{ctx.world_size} ranks, backend {ctx.backend}, model {args.model}, "
                  f"global batch {cfg.batch_size} ({cfg.batch_size // ctx.world_size} per rank)",
                  flush=True)
        result = train_ddp(cfg, ctx, data, model, hooks=hooks)
        if ctx.is_main:
            print(f"done: {result.num_epochs} epochs, final test acc {result.test_acc[-1]:.3f}",
                  flush=True)
        return result


def command_line(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as ``python -m d2lgpu.ddp_train`` runs it; returns the exit status (1 on
    failure, with the message alone where a traceback adds nothing)."""
    return exit_status_of(lambda: main(argv),
                          brief=(CheckpointError, FloatingPointError, CollectiveTimeout))


if __name__ == "__main__":
    end_process(command_line())  # never through interpreter teardown: see end_process
