"""Train on Fashion-MNIST with DistributedDataParallel: the torchrun entry point of chapter 5::

    torchrun --standalone --nproc_per_node=2 -m d2lgpu.ddp_train --epochs 2

With ``--snapshot``, rank 0 writes a SHA-256-checked snapshot after every epoch, and a
restarted job (``torchrun --max-restarts=N``) continues from it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from d2lgpu.devices import try_gpu
from d2lgpu.precision import PRECISIONS, PrecisionPolicy, check_precision, precision_policy
from d2lgpu.runtime.checks import (
    check_bool,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_training_loss,
    check_writable_path,
    positive_int_flag,
    positive_number_flag,
    seed_flag,
)
from d2lgpu.runtime.config import small_data
from d2lgpu.runtime.distributed import (
    DEFAULT_TIMEOUT_S,
    CollectiveTimeout,
    DistContext,
    add_job_flags,
    all_reduce_sum,
    end_process,
    mark_progress,
    process_group,
)
from d2lgpu.training import History

__all__ = [
    "MODELS", "DDPConfig", "DDPResult", "SnapshotError", "build_model", "command_line",
    "ddp_worker", "main", "read_snapshot", "strip_batchnorm", "train_ddp",
]

#: ``small_cnn_nobn`` has no batch norm, which normalises with the *local* batch's
#: statistics: without it DDP matches one process on the whole batch to rounding error.
MODELS = ("resnet18", "small_cnn", "small_cnn_nobn")

#: (train images, train labels, test images, test labels), instead of Fashion-MNIST.
Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class DDPConfig:
    """Everything that defines a run; the command-line flags map one to one onto it (chapter 5)."""

    epochs: int = 2
    batch_size: int = 256  # global, split evenly over the ranks
    lr: float = 0.1
    model: str = "small_cnn"
    data_root: str | None = None  # None: d2lgpu.data_root()
    snapshot: str | None = None  # resumed from, and rewritten after every epoch
    seed: int = 0
    quick: bool | None = None  # None follows D2LGPU_QUICK
    log: bool = True  # rank 0 prints one line per epoch
    #: The last rank raises after this epoch, on the first attempt only (to try restarts).
    fail_after_epoch: int | None = None
    #: A word of d2lgpu.precision.PRECISIONS; "fp32" is strict (TF32 off), so that DDP can
    #: be compared with one process to 1e-5.
    precision: str = "fp32"

    def __post_init__(self) -> None:
        check_positive_int("epochs", self.epochs)
        check_positive_int("batch_size", self.batch_size)
        check_positive_float("lr", self.lr)
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        check_seed(self.seed)
        if self.fail_after_epoch is not None:
            check_positive_int("fail_after_epoch", self.fail_after_epoch)
        check_bool("quick", self.quick, none_means="follow D2LGPU_QUICK")
        check_precision(self.precision)
        check_bool("log", self.log)
        for name in ("snapshot", "data_root"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path (a str or pathlib.Path) or None, got "
                                f"{type(value).__name__} {value!r}")
            setattr(self, name, value and os.fspath(value))


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


# --- Snapshots ---
class SnapshotError(ValueError):
    """A snapshot this run cannot continue from; the message names the file and the way out."""


_HISTORY_KEYS = ("train_loss", "train_acc", "test_acc", "epoch_seconds", "examples_per_second")
_SNAPSHOT_KEYS = ("model", "optimizer", "epochs_done", "history", "config")
_SNAPSHOT_FORMAT = "d2lgpu.ddp_train snapshot, sha256-checked"

#: Settings a resumed run must share with the snapshot's, with their flags.
_MUST_MATCH = {"model": "--model", "batch_size": "--batch-size", "lr": "--lr", "seed": "--seed",
               "quick": "--quick/--full", "precision": "--precision"}


def _start_fresh(path: Path) -> str:
    return f"to start fresh, pass another --snapshot path or delete {path}"


def _recorded_config(cfg: DDPConfig) -> dict:
    return asdict(cfg) | {"quick": small_data() if cfg.quick is None else cfg.quick}


def _save_snapshot(path: Path, state: dict) -> None:
    """Write ``state`` and the SHA-256 of its bytes, atomically (temporary file, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": _SNAPSHOT_FORMAT, "sha256": hashlib.sha256(payload).hexdigest(),
                "state": payload}, tmp)
    os.replace(tmp, path)


def read_snapshot(path: str | os.PathLike) -> dict:
    """The state a ``ddp_train`` snapshot holds (model, optimizer, epochs_done, history,
    config), its checksum verified (chapter 5)."""
    path = Path(path)
    if not path.exists():
        raise SnapshotError(f"there is no snapshot at {path}")
    return _read_snapshot(path)


def _read_snapshot(path: Path) -> dict:
    if path.stat().st_size == 0:
        raise SnapshotError(f"snapshot {path} is empty (0 bytes); {_start_fresh(path)}")
    try:
        # weights_only: no code runs on loading.
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch's weights-only loader wraps the reason in a page of advice on trusting files.
        reason = str(exc).split("WeightsUnpickler error:")[-1].strip().splitlines()
        raise SnapshotError(
            f"cannot read snapshot {path} ({type(exc).__name__}: {reason[0] if reason else ''}): "
            f"it is damaged or was not written by d2lgpu.ddp_train; {_start_fresh(path)}"
        ) from exc
    if not isinstance(snapshot, dict) or snapshot.get("format") != _SNAPSHOT_FORMAT:
        raise SnapshotError(f"snapshot {path} is not a checksummed snapshot of d2lgpu.ddp_train; "
                            f"{_start_fresh(path)}")
    payload = snapshot["state"]
    if hashlib.sha256(payload).hexdigest() != snapshot["sha256"]:
        raise SnapshotError(f"snapshot {path} is damaged: its contents do not match the SHA-256 "
                            f"checksum written with it; {_start_fresh(path)}")
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    missing = [repr(key) for key in _SNAPSHOT_KEYS if key not in state]
    if missing:
        raise SnapshotError(f"snapshot {path} lacks {', '.join(missing)}, so d2lgpu.ddp_train "
                            f"did not write it; {_start_fresh(path)}")
    return state


def _load_snapshot(path: Path | None, ctx: DistContext | None) -> dict | None:
    """Rank 0 reads the snapshot, if any, checks it can write there, and sends it to every
    rank (the other machines need no shared file system); all ranks raise alike."""
    snapshot, problem = None, None
    if (ctx is None or ctx.is_main) and path is not None:
        try:
            check_writable_path("--snapshot", path)
            if path.exists():
                snapshot = _read_snapshot(path)
        except SnapshotError as exc:
            problem = str(exc)
        except (ValueError, PermissionError) as exc:
            problem = f"cannot write snapshot {path}: {exc}"
    if ctx is not None and ctx.world_size > 1:
        box = [(snapshot, problem)]
        dist.broadcast_object_list(box, src=0)
        snapshot, problem = box[0]
    if problem is not None:
        raise SnapshotError(problem)
    return snapshot


def _check_resumable(snapshot: dict, cfg: DDPConfig, path: Path) -> None:
    """Refuse a snapshot written under other settings, or with more epochs than asked for."""
    old, new = snapshot["config"], _recorded_config(cfg)
    mode = {True: "--quick", False: "--full"}
    differences = [
        f"{mode[old[key]]} in the snapshot, {mode[new[key]]} now" if key == "quick"
        else f"{flag} {old[key]} in the snapshot, {new[key]} now"
        for key, flag in _MUST_MATCH.items() if old[key] != new[key]
    ]
    if differences:
        raise SnapshotError(
            f"snapshot {path} was written with other settings ({'; '.join(differences)}); "
            "resuming would continue its model and optimizer under the new ones. Rerun with "
            f"the snapshot's settings; or, {_start_fresh(path)}"
        )
    done = snapshot["epochs_done"]
    if done > cfg.epochs:
        raise SnapshotError(
            f"snapshot {path} already holds {done} epochs, more than --epochs {cfg.epochs} (the "
            f"total, not the number to add): pass --epochs {done + 1} or more; or, "
            f"{_start_fresh(path)}"
        )


# --- Training ---
def _check_data(data: object) -> None:
    """``data`` must be (train images, train labels, test images, test labels), finite."""
    if not (isinstance(data, (tuple, list)) and len(data) == 4
            and all(isinstance(t, torch.Tensor) for t in data)):
        raise TypeError("data must be a tuple of 4 tensors (train images, train labels, test "
                        f"images, test labels) or None, got {type(data).__name__}")
    for name, images, labels in (("train", data[0], data[1]), ("test", data[2], data[3])):
        if len(images) == 0:
            raise ValueError(f"the {name} set is empty (0 {name} images): pass at least one "
                             "example per rank")
        if len(images) != len(labels) or labels.is_floating_point():
            raise ValueError(f"{len(images)} {name} images need as many integer class labels, "
                             f"got {len(labels)} of {labels.dtype}")
        if images.is_floating_point() and not torch.isfinite(images).all():
            raise ValueError(f"the {name} images hold nan or inf: clean the data before training")


def _make_loaders(
    cfg: DDPConfig, data: Tensors4 | None, rank: int, world_size: int
) -> tuple[DistributedSampler, DataLoader, DataLoader]:
    """This rank's sampler and loaders (Fashion-MNIST unless ``data`` is given): its slice of
    every epoch's shuffle, and of the test set."""
    if data is None:
        from d2lgpu.data import fashion_mnist_tensors

        data = (*fashion_mnist_tensors(train=True, root=cfg.data_root, quick=cfg.quick),
                *fashion_mnist_tensors(train=False, root=cfg.data_root, quick=cfg.quick))
    images = [x.float() / 255 if x.dtype == torch.uint8 else x.float() for x in data[::2]]
    train_set = TensorDataset(images[0], data[1])
    # Every world_size-th test example, no padding: the summed counts are the test set.
    test_set = Subset(TensorDataset(images[1], data[3]), range(rank, len(data[3]), world_size))
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed)
    local_batch = cfg.batch_size // world_size
    return (sampler, DataLoader(train_set, batch_size=local_batch, sampler=sampler),
            DataLoader(test_set, batch_size=local_batch))


def _train_epoch(
    net: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy,
    scaler: torch.amp.GradScaler, device: torch.device,
) -> tuple[float, float, int, float]:
    """One pass over this rank's batches: (summed loss, correct, examples, first loss)."""
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    loss_sum, correct = torch.zeros((), device=device), torch.zeros((), device=device)
    first_loss, seen = None, 0
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            logits = net(X)
            loss = loss_fn(logits.float(), y)
        if first_loss is None:
            first_loss = loss.detach().clone()  # read with the sums, at the epoch's end
        # The gradients arrive averaged over the ranks, so every rank's scaler skips alike.
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach() * len(y)
        correct += (logits.argmax(dim=1) == y).sum()
        seen += len(y)
    return loss_sum.item(), correct.item(), seen, first_loss.item()


def _count_correct(net: nn.Module, loader: DataLoader, device: torch.device,
                   policy: PrecisionPolicy) -> tuple[int, int]:
    net.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)  # read once, not per batch
    seen = 0
    with torch.no_grad():
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            with policy.autocast():
                logits = net(X)
            correct += (logits.argmax(dim=1) == y).sum()
            seen += len(y)
    return int(correct), seen


def _resume(
    snapshot: dict | None, model: nn.Module, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler, cfg: DDPConfig, path: Path | None, say: bool,
) -> tuple[int, dict[str, list[float]], float | None]:
    """Load the snapshot's state, if any; return its epochs done, history and start loss."""
    if snapshot is None:
        return 0, {k: [] for k in _HISTORY_KEYS}, None
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    if snapshot.get("scaler"):
        scaler.load_state_dict(snapshot["scaler"])
    done = snapshot["epochs_done"]
    if say and done == cfg.epochs:
        print(f"snapshot {path} already holds all {done} epochs: nothing left to train "
              "(--epochs is the total; pass a larger one to train on)", flush=True)
    elif say:
        print(f"resuming from {path} after epoch {done}", flush=True)
    return done, snapshot["history"], snapshot.get("start_loss")


def _record_epoch(
    history: dict[str, list[float]], stats: list, seconds: float, epoch: int, steps: int,
    cfg: DDPConfig, start_loss: float,
) -> None:
    """Append one epoch's whole-job totals to ``history``, unless the loss diverged (judged
    on totals every rank shares, so all stop together, before the snapshot is written)."""
    loss_sum, correct, seen, _, test_correct, test_seen = stats
    check_training_loss(
        loss_sum / seen, when=f"epoch {epoch + 1} (steps {epoch * steps + 1}-"
        f"{(epoch + 1) * steps})", lr=cfg.lr, first_loss=start_loss,
        advice="stopped before writing this epoch to the snapshot",
    )
    values = (loss_sum / seen, correct / seen, test_correct / test_seen, seconds, seen / seconds)
    for key, value in zip(_HISTORY_KEYS, values, strict=True):
        history[key].append(value)


def _epoch_line(history: dict[str, list[float]], epoch: int, cfg: DDPConfig,
                ctx: DistContext | None) -> str:
    last = {key: values[-1] for key, values in history.items()}
    return (f"epoch {epoch + 1}/{cfg.epochs}: loss {last['train_loss']:.3f}, train acc "
            f"{last['train_acc']:.3f}, test acc {last['test_acc']:.3f}, {last['epoch_seconds']:.1f}"
            f" s, {last['examples_per_second']:.0f} examples/s ({ctx.world_size if ctx else 1} "
            f"rank(s), {ctx.backend if ctx else 'no process group'})")


def train_ddp(
    cfg: DDPConfig,
    ctx: DistContext | None = None,
    data: Tensors4 | None = None,
    device: torch.device | None = None,
) -> DDPResult:
    """Train ``cfg.model`` with DDP inside the process group ``ctx`` (chapter 5); ``ctx=None``
    trains in this one process, the baseline DDP must reproduce. ``data`` replaces
    Fashion-MNIST."""
    world_size, rank = (ctx.world_size, ctx.rank) if ctx is not None else (1, 0)
    if data is not None:
        _check_data(data)
    if cfg.batch_size % world_size:
        raise ValueError(f"batch_size={cfg.batch_size} is the global batch and must be divisible "
                         f"by the {world_size} ranks: use a multiple of {world_size}")
    device = device or (ctx.device if ctx is not None else torch.device("cpu"))
    # The snapshot first: a run that cannot continue from it fails before loading any data.
    path = Path(cfg.snapshot) if cfg.snapshot else None
    snapshot = _load_snapshot(path, ctx)
    if snapshot is not None:
        _check_resumable(snapshot, cfg, path)
    sampler, train_loader, test_loader = _make_loaders(cfg, data, rank, world_size)
    torch.manual_seed(cfg.seed)  # the same initial weights everywhere
    model = build_model(cfg.model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    policy = precision_policy(device, cfg.precision)
    scaler = policy.make_scaler()
    start_epoch, history, start_loss = _resume(
        snapshot, model, optimizer, scaler, cfg, path, rank == 0 and cfg.log)
    # DDP's hooks all-reduce gradient buckets while backward is still running.
    net = model if ctx is None else DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    with policy.matmul_precision():  # TF32 on or off, as the precision says (CUDA only)
        for epoch in range(start_epoch, cfg.epochs):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, identical on all ranks
            mark_progress(f"epoch {epoch + 1} started")  # named if a peer times out waiting
            started = time.perf_counter()
            stats = [*_train_epoch(net, train_loader, optimizer, policy, scaler, device),
                     *_count_correct(net, test_loader, device, policy)]
            if ctx is not None:
                stats = all_reduce_sum(stats, ctx)  # whole-job totals on every rank
            if start_loss is None:
                start_loss = stats[3] / world_size  # the mean of the ranks' first batches
            _record_epoch(history, stats, time.perf_counter() - started, epoch,
                          len(train_loader), cfg, start_loss)
            if rank == 0 and cfg.log:
                print(_epoch_line(history, epoch, cfg, ctx), flush=True)
            if rank == 0 and path is not None:
                _save_snapshot(path, {
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),  # empty unless fp16 scales the loss
                    "epochs_done": epoch + 1, "history": history, "start_loss": start_loss,
                    "config": _recorded_config(cfg),
                })
            if ctx is not None:
                mark_progress(f"barrier after epoch {epoch + 1}")
                dist.barrier()  # nobody moves on (or fails, below) before the snapshot is on disk
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            if cfg.fail_after_epoch == epoch + 1 and rank == world_size - 1 and not restarted:
                raise RuntimeError(f"simulated failure of rank {rank} after epoch {epoch + 1} "
                                   "(--fail-after-epoch)")
    return DDPResult(
        world_size=world_size, backend=ctx.backend if ctx is not None else "none",
        resumed_from_epoch=start_epoch, device=str(device),
        state_dict={k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, **history,
    )


def ddp_worker(
    rank: int, world_size: int, master_port: int, cfg: DDPConfig, data: Tensors4 | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DDPResult:
    """What :func:`d2lgpu.runtime.distributed.launch` runs: join the group, train, leave
    (chapter 5)."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=timeout_s) as ctx:
        return train_ddp(cfg, ctx, data)


def _parse_args(argv: Sequence[str] | None) -> tuple[DDPConfig, float]:
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m d2lgpu.ddp_train",
                                     description=__doc__.split("::")[0])
    parser.add_argument("--epochs", type=positive_int_flag, default=DDPConfig.epochs,
                        help="total epochs, including those a snapshot already holds")
    parser.add_argument("--batch-size", type=positive_int_flag, default=DDPConfig.batch_size,
                        help="global batch size, split evenly over the ranks")
    parser.add_argument("--lr", type=positive_number_flag, default=DDPConfig.lr)
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="default: small_cnn in quick mode, resnet18 otherwise")
    parser.add_argument("--snapshot", default=None,
                        help="resume from this file if it exists, and rewrite it after every epoch")
    parser.add_argument("--seed", type=seed_flag, default=DDPConfig.seed)
    parser.add_argument("--precision", choices=PRECISIONS, default=DDPConfig.precision,
                        help="fp32 (strict, the default), tf32, fp16 (with loss scaling), bf16, "
                        "or auto: the device's fast format (d2lgpu.precision_policy)")
    add_job_flags(parser, crash_point="this epoch")
    args = parser.parse_args(argv)
    quick = small_data() if args.quick is None else args.quick
    model = args.model or ("small_cnn" if quick else "resnet18")
    settings = {k: v for k, v in vars(args).items() if k not in ("timeout", "model", "quick")}
    return DDPConfig(model=model, quick=quick, **settings), args.timeout


def main(argv: Sequence[str] | None = None) -> DDPResult:
    """Command line: under torchrun every process joins the group; run directly, it trains alone."""
    cfg, timeout_s = _parse_args(argv)
    if "RANK" not in os.environ:
        device = try_gpu()
        print(f"not started by torchrun: training in this one process on {device}, "
              "without a process group")
        return train_ddp(cfg, None, device=device)
    with process_group(timeout_s=timeout_s) as ctx:
        if ctx.is_main:
            print(f"{ctx.world_size} ranks, backend {ctx.backend}, model {cfg.model}, "
                  f"global batch {cfg.batch_size} ({cfg.batch_size // ctx.world_size} per rank)",
                  flush=True)
        result = train_ddp(cfg, ctx)
        if ctx.is_main:
            print(f"done: {result.num_epochs} epochs, final test acc {result.test_acc[-1]:.3f}",
                  flush=True)
        return result


def command_line(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as ``python -m d2lgpu.ddp_train`` runs it; returns the exit status (1 on
    failure, with the message alone where a traceback adds nothing)."""
    try:
        main(argv)
    except (SnapshotError, FloatingPointError, CollectiveTimeout) as exc:
        print(f"d2lgpu.ddp_train: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    end_process(command_line())  # never through interpreter teardown: see end_process
