"""Train on Fashion-MNIST with DistributedDataParallel: the torchrun entry point of chapter 5.

One machine, two processes (GPUs when there are two, CPU and gloo otherwise)::

    torchrun --standalone --nproc_per_node=2 -m d2lgpu.ddp_train --epochs 2

Two machines, with the c10d rendezvous: the same line on both (torchrun numbers the
machines itself and ignores ``--node-rank`` here), with the address of machine 0 in
``--rdzv-endpoint``::

    torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 --rdzv-id=job1 -m d2lgpu.ddp_train

or with the static rendezvous, numbering the machines yourself (``R`` = 0 on HOST0, 1 on
the other)::

    torchrun --nnodes=2 --node-rank=R --nproc_per_node=1 \\
        --master-addr=HOST0 --master-port=29500 -m d2lgpu.ddp_train

What every rank does, top to bottom in :func:`train_ddp`: same seed, same
initial model (DDP also broadcasts rank 0's weights); a ``DistributedSampler``
gives each rank a different slice of a shuffle that changes every epoch
(``set_epoch``); DDP averages the gradients across ranks during ``backward``;
losses and accuracies are summed over ranks with one all-reduce per epoch;
rank 0 alone prints and writes the snapshot (model, optimizer, epochs done,
history, with a SHA-256 checksum verified on loading), atomically, after every
epoch; its path is checked for writing before the first epoch. With a snapshot path, a restarted job
(``torchrun --max-restarts=N`` restarts all workers after a failure) continues
from the last completed epoch instead of starting over.

``--batch-size`` is the **global** batch: every step processes that many
examples in total, ``batch_size / world_size`` on each rank, so the same
command trains the same model whatever the number of processes.

A snapshot continues only the run that wrote it: resuming with another
``--model``, ``--batch-size``, ``--lr``, ``--seed``, ``--precision`` or
``--quick``/``--full``, or with fewer ``--epochs`` than it holds, is refused
(:class:`SnapshotError`), as is a file that is not a snapshot or does not match its checksum.
``--epochs`` is the total: with as many epochs as the snapshot holds there is
nothing left to train, which it says, and exits 0. A training loss that is not
finite (nan or inf) at the end of an epoch stops the run with
``FloatingPointError`` before that epoch is written to the snapshot. On the
command line these errors print their message (no
traceback) and exit with status 1; bad flag values are usage errors (status 2).
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
    "MODELS",
    "DDPConfig",
    "DDPResult",
    "SnapshotError",
    "build_model",
    "command_line",
    "ddp_worker",
    "main",
    "read_snapshot",
    "strip_batchnorm",
    "train_ddp",
]

#: Model names accepted by ``--model``. ``small_cnn_nobn`` is small_cnn without its
#: batch-norm layers: batch norm normalises with statistics of the *local* batch, so
#: two ranks on half batches compute slightly different activations than one process
#: on the whole batch; without it DDP matches single-process training to rounding error.
MODELS = ("resnet18", "small_cnn", "small_cnn_nobn")

#: Tensors a caller may pass instead of Fashion-MNIST:
#: (train images, train labels, test images, test labels).
Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class DDPConfig:
    """Everything that defines a run; the command-line flags map one to one onto it (chapter 5)."""

    epochs: int = 2
    #: Global batch size, split evenly over the ranks.
    batch_size: int = 256
    lr: float = 0.1
    model: str = "small_cnn"
    #: Where FashionMNIST/raw lives; None means d2lgpu.data_root().
    data_root: str | None = None
    #: Snapshot file to resume from and to write after each epoch; None: no snapshots.
    snapshot: str | None = None
    seed: int = 0
    #: Quick-mode data subset; None follows D2LGPU_QUICK.
    quick: bool | None = None
    #: Rank 0 prints one line per epoch.
    log: bool = True
    #: For demonstrating restarts: the last rank raises after this epoch's snapshot,
    #: on the first attempt only (torchrun counts attempts in TORCHELASTIC_RESTART_COUNT).
    fail_after_epoch: int | None = None
    #: A word of :data:`d2lgpu.precision.PRECISIONS`, turned into autocast, loss scaling and
    #: TF32 by :func:`d2lgpu.precision_policy` on the rank's device. "fp32" (the default)
    #: is strict fp32, TF32 off on GPUs, so that DDP can be compared with one process to
    #: 1e-5, not 1e-3; "tf32" allows TF32 in fp32 matmuls and convolutions (CUDA only);
    #: "fp16" and "bf16" autocast (fp16 with a GradScaler); "auto" lets the device decide.
    #: TF32 settings come back afterwards.
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
        if self.quick not in (None, True, False):
            raise ValueError(f"quick must be True, False or None, got {self.quick!r}")
        check_precision(self.precision)
        check_bool("log", self.log)
        for name in ("snapshot", "data_root"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(
                    f"{name} must be a path (a str or pathlib.Path) or None, got "
                    f"{type(value).__name__} {value!r}"
                )
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))


@dataclass
class DDPResult(History):
    """What a run returns: the :class:`~d2lgpu.training.History` of :func:`~d2lgpu.train`,
    plus what only a DDP job has (on rank 0 in full; the same numbers on every rank).

    The per-epoch lists cover every epoch of the run, including those done
    before a restart (they come back from the snapshot). ``state_dict`` is the
    final model on the CPU, for comparing runs.
    """

    world_size: int = 1
    #: "gloo" or "nccl"; "none" for one process without a process group.
    backend: str = "none"
    #: Epochs that were already done when this process started (0 without a snapshot).
    resumed_from_epoch: int = 0
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)


def strip_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every batch-norm layer of ``module`` by ``nn.Identity``, in place; returns it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(module, name, nn.Identity())
        else:
            strip_batchnorm(child)
    return module


def build_model(name: str) -> nn.Module:
    """A fresh model by name (see :data:`MODELS`), for 1-channel 28x28 images and 10 classes
    (chapter 5)."""
    from d2lgpu.models import resnet18, small_cnn

    if name == "resnet18":
        return resnet18()
    if name == "small_cnn":
        return small_cnn()
    if name == "small_cnn_nobn":
        return strip_batchnorm(small_cnn())
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def _load_tensors(cfg: DDPConfig) -> Tensors4:
    from d2lgpu.data import fashion_mnist_tensors

    train_x, train_y = fashion_mnist_tensors(train=True, root=cfg.data_root, quick=cfg.quick)
    test_x, test_y = fashion_mnist_tensors(train=False, root=cfg.data_root, quick=cfg.quick)
    return train_x, train_y, test_x, test_y


def _as_float_images(images: torch.Tensor) -> torch.Tensor:
    # uint8 pixels become floats in [0, 1], as torchvision's ToTensor does.
    return images.float() / 255 if images.dtype == torch.uint8 else images.float()


class SnapshotError(ValueError):
    """A snapshot this run cannot continue from; the message names the file and the way out."""


#: The per-epoch lists a snapshot's history holds.
_HISTORY_KEYS = ("train_loss", "train_acc", "test_acc", "epoch_seconds", "examples_per_second")

#: What a snapshot holds (see the end of every epoch in :func:`train_ddp`).
_SNAPSHOT_KEYS = ("model", "optimizer", "epochs_done", "history", "config")

#: Settings a resumed run must share with the run that wrote the snapshot, with their flags:
#: the model and optimizer state in it only mean something under those settings.
_MUST_MATCH = {
    "model": "--model",
    "batch_size": "--batch-size",
    "lr": "--lr",
    "seed": "--seed",
    "quick": "--quick/--full",
    "precision": "--precision",
}


def _start_fresh(path: Path) -> str:
    return f"to start fresh, pass another --snapshot path or delete {path}"


def _recorded_config(cfg: DDPConfig) -> dict:
    """``cfg`` as a snapshot records it, with quick mode resolved (None follows the environment)."""
    return asdict(cfg) | {"quick": small_data() if cfg.quick is None else cfg.quick}


#: Marks a snapshot file: its state, serialised, and the SHA-256 of those bytes.
_SNAPSHOT_FORMAT = "d2lgpu.ddp_train snapshot, sha256-checked"


def _save_snapshot(path: Path, state: dict) -> None:
    """Write ``state`` with its checksum to a temporary file and rename it.

    The rename means a crash mid-write leaves the old snapshot intact; the SHA-256
    of the serialised state means a file damaged later (a disk, a copy, a hand) is
    refused on loading instead of resuming from corrupt weights.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    torch.save(
        {"format": _SNAPSHOT_FORMAT, "sha256": hashlib.sha256(payload).hexdigest(),
         "state": payload},
        tmp,
    )
    os.replace(tmp, path)


def read_snapshot(path: str | os.PathLike) -> dict:
    """The state a ``ddp_train`` snapshot holds (model, optimizer, epochs_done, history, config),
    after checking the file's checksum; a :class:`SnapshotError` names what is wrong (chapter 5)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or pathlib.Path, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise SnapshotError(f"there is no snapshot at {path}")
    return _read_snapshot(path)


def check_snapshot_path(path: Path) -> None:
    """Fail now, before any training, when the snapshot cannot be written at ``path``.

    The first snapshot is written after the first epoch; a path under a regular
    file, in a read-only place or under ``/proc`` would otherwise fail only then.
    Creates the missing directories and writes and removes a probe file.
    """
    if path.is_dir():
        raise SnapshotError(
            f"snapshot path {path} is a directory; --snapshot takes a file name (the file is "
            "created after the first epoch): pass a file path, e.g. "
            f"--snapshot {path / 'snapshot.pt'}"
        )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SnapshotError(
                    f"cannot write snapshot {path}: {parent} is a file, not a directory; pass "
                    "a --snapshot path in a directory"
                )
            break
    probe = path.with_name(path.name + ".probe")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise SnapshotError(
            f"cannot write snapshot {path} ({type(exc).__name__}: {exc.strerror or exc}): pass "
            "a --snapshot path in a directory you can write to"
        ) from None


def _read_snapshot(path: Path) -> dict:
    """The snapshot at ``path``, or a :class:`SnapshotError` saying what is wrong with the file."""
    if path.is_dir():
        raise SnapshotError(
            f"snapshot path {path} is a directory; --snapshot takes a file name (the file is "
            "created after the first epoch): pass a file path, e.g. "
            f"--snapshot {path / 'snapshot.pt'}"
        )
    if not path.is_file():
        raise SnapshotError(f"snapshot path {path} is not a regular file; {_start_fresh(path)}")
    if path.stat().st_size == 0:
        raise SnapshotError(f"snapshot {path} is empty (0 bytes); {_start_fresh(path)}")
    try:
        # Only tensors, numbers, strings and containers: no code runs on loading.
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch's weights-only loader wraps the reason in a page of advice on trusting files.
        reason = str(exc).split("WeightsUnpickler error:")[-1]
        raise SnapshotError(
            f"cannot read snapshot {path} ({type(exc).__name__}: {_first_line(reason)}): it is "
            f"damaged or was not written by d2lgpu.ddp_train; {_start_fresh(path)}"
        ) from exc
    if not isinstance(snapshot, dict) or snapshot.get("format") != _SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"snapshot {path} is not a checksummed snapshot of d2lgpu.ddp_train (it holds a "
            f"{type(snapshot).__name__}{' of other keys' if isinstance(snapshot, dict) else ''})"
            f"; {_start_fresh(path)}"
        )
    payload = snapshot.get("state")
    if not isinstance(payload, bytes) or hashlib.sha256(payload).hexdigest() != snapshot.get(
        "sha256"
    ):
        raise SnapshotError(
            f"snapshot {path} is damaged: its contents do not match the SHA-256 checksum written "
            f"with it; {_start_fresh(path)}"
        )
    try:
        snapshot = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise SnapshotError(
            f"cannot read the state in snapshot {path} ({type(exc).__name__}); "
            f"{_start_fresh(path)}"
        ) from exc
    if not isinstance(snapshot, dict):
        raise SnapshotError(
            f"snapshot {path} holds a {type(snapshot).__name__}, not the dict that "
            f"d2lgpu.ddp_train writes; {_start_fresh(path)}"
        )
    missing = [repr(key) for key in _SNAPSHOT_KEYS if key not in snapshot]
    if not missing and isinstance(snapshot["config"], dict):
        missing = [f"config[{key!r}]" for key in _MUST_MATCH if key not in snapshot["config"]]
    elif not missing:
        missing = ["a config dict"]
    if missing:
        raise SnapshotError(
            f"snapshot {path} lacks {', '.join(missing)}, so d2lgpu.ddp_train did not write it "
            f"(or an older version did); {_start_fresh(path)}"
        )
    return snapshot


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _load_snapshot(path: Path | None, ctx: DistContext | None) -> dict | None:
    """Rank 0 reads the snapshot, if any, checks it can write there, and sends it to every rank.

    Only rank 0 needs to see the file, so it works when the other machines of a
    multi-node job have no shared file system. When the file is unusable, every
    rank raises the same :class:`SnapshotError` (none is left waiting for rank 0).
    """
    snapshot: dict | None = None
    problem: str | None = None
    if (ctx is None or ctx.is_main) and path is not None:
        try:
            if path.exists() or path.is_symlink():
                snapshot = _read_snapshot(path)
            check_snapshot_path(path)  # writable: fail now, not after the first epoch
        except SnapshotError as exc:
            if ctx is None or ctx.world_size == 1:
                raise
            problem = str(exc)
    if ctx is not None and ctx.world_size > 1:
        box = [(snapshot, problem)]
        dist.broadcast_object_list(box, src=0)
        snapshot, problem = box[0]
    if problem is not None:
        raise SnapshotError(problem)
    return snapshot


def _difference(key: str, old: object, new: object) -> str:
    if key == "quick":
        mode = {True: "--quick", False: "--full"}
        return f"{mode.get(old, old)} in the snapshot, {mode.get(new, new)} now"
    return f"{_MUST_MATCH[key]} {old} in the snapshot, {new} now"


def _check_resumable(snapshot: dict, cfg: DDPConfig, path: Path) -> None:
    """Refuse a snapshot written under other settings, or with more epochs than asked for."""
    old, new = snapshot["config"], _recorded_config(cfg)
    differences = [
        _difference(key, old[key], new[key]) for key in _MUST_MATCH if old[key] != new[key]
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
            f"snapshot {path} already holds {done} epochs, more than --epochs {cfg.epochs}: "
            f"--epochs is the total number of epochs, not the number to add: pass "
            f"--epochs {done + 1} or more to train on; or, {_start_fresh(path)}"
        )


def _check_train_args(
    cfg: object, ctx: object, data: object, device: object
) -> tuple[int, int]:
    """Refuse bad arguments to :func:`train_ddp`; return (world size, rank) of this process."""
    if not isinstance(cfg, DDPConfig):
        raise TypeError(f"cfg must be a DDPConfig, got {type(cfg).__name__}")
    if ctx is not None and not isinstance(ctx, DistContext):
        raise TypeError(
            f"ctx must be the DistContext that process_group() yields, or None, got "
            f"{type(ctx).__name__}"
        )
    if device is not None and not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or None, got {device!r}")
    if data is not None:
        _check_data(data)
    world_size, rank = (ctx.world_size, ctx.rank) if ctx is not None else (1, 0)
    if cfg.batch_size % world_size:
        raise ValueError(
            f"batch_size={cfg.batch_size} is the global batch and must be divisible by the "
            f"{world_size} ranks: use a multiple of {world_size}"
        )
    return world_size, rank


def _make_loaders(
    cfg: DDPConfig, data: Tensors4, rank: int, world_size: int
) -> tuple[DistributedSampler, DataLoader, DataLoader]:
    """This rank's sampler and loaders: its slice of every epoch's shuffle, and of the test set."""
    train_x, train_y, test_x, test_y = data
    local_batch = cfg.batch_size // world_size
    train_set = TensorDataset(_as_float_images(train_x), train_y)
    # Evaluation: every rank takes every world_size-th test example; no padding,
    # so the summed counts are exactly the test set.
    test_set = Subset(
        TensorDataset(_as_float_images(test_x), test_y), range(rank, len(test_y), world_size)
    )
    # The same permutation on every rank (seed + epoch); rank r takes positions r, r+W, ...
    sampler = DistributedSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed
    )
    train_loader = DataLoader(train_set, batch_size=local_batch, sampler=sampler)
    test_loader = DataLoader(test_set, batch_size=local_batch)
    return sampler, train_loader, test_loader


def _resume(
    snapshot: dict,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: DDPConfig,
    path: Path,
    say: bool,
) -> tuple[int, dict[str, list[float]]]:
    """Load the snapshot's model and optimizer; return its epochs done and history."""
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    start_epoch = snapshot["epochs_done"]
    if say:
        if start_epoch == cfg.epochs:
            print(
                f"snapshot {path} already holds all {start_epoch} epochs: nothing "
                "left to train (--epochs is the total; pass a larger one to train on)",
                flush=True,
            )
        else:
            print(f"resuming from {path} after epoch {start_epoch}", flush=True)
    return start_epoch, snapshot["history"]


def _train_epoch(
    net: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    policy: PrecisionPolicy,
    scaler: torch.amp.GradScaler,
    device: torch.device,
) -> tuple[float, float, int, float]:
    """One pass over this rank's batches; returns its (summed loss, correct, examples,
    first batch's loss). The last is the start that the divergence rule measures against.

    ``policy`` says whether forward runs under autocast; ``scaler`` scales the loss
    for fp16 and does nothing otherwise (:meth:`PrecisionPolicy.make_scaler`).
    """
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device)
    first_loss = None
    seen = 0
    for X, y in loader:
        X, y = X.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            logits = net(X)
            loss = loss_fn(logits.float(), y)
        if first_loss is None:
            first_loss = loss.detach().clone()  # read with the sums, at the epoch's end
        # With DDP, gradients arrive here already averaged over ranks; every rank then
        # sees the same overflow (or none), so the scaler skips the same steps everywhere.
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach() * len(y)
        correct += (logits.argmax(dim=1) == y).sum()
        seen += len(y)
    if first_loss is None:
        raise ValueError("this rank's training loader yielded no batches: the training set "
                         "is empty (pass at least one example per rank)")
    return loss_sum.item(), correct.item(), seen, first_loss.item()


def _record_epoch(
    history: dict[str, list[float]], stats: list, seconds: float, epoch: int, cfg: DDPConfig,
    steps_per_epoch: int, start_loss: float | None,
) -> None:
    """Append one epoch's whole-job totals to ``history``; refuse a diverged loss.

    Checked once per epoch (no extra GPU sync per step), on the totals every rank
    shares, so all ranks stop together; the snapshot keeps the last good epoch. The rule
    is the course's one (:func:`d2lgpu.runtime.checks.check_training_loss`), against
    ``start_loss``, the job's first step's loss.
    """
    loss_sum, correct, seen, _, test_correct, test_seen = stats
    check_training_loss(
        loss_sum / seen,
        when=(f"epoch {epoch + 1} (steps {epoch * steps_per_epoch + 1}-"
              f"{(epoch + 1) * steps_per_epoch})"),
        lr=cfg.lr, first_loss=start_loss,
        advice="stopped before writing this epoch to the snapshot",
    )
    history["train_loss"].append(loss_sum / seen)
    history["train_acc"].append(correct / seen)
    history["test_acc"].append(test_correct / test_seen)
    history["epoch_seconds"].append(seconds)
    history["examples_per_second"].append(seen / seconds)


def _epoch_line(
    history: dict[str, list[float]], epoch: int, cfg: DDPConfig, ctx: DistContext | None
) -> str:
    """What rank 0 prints after an epoch."""
    return (
        f"epoch {epoch + 1}/{cfg.epochs}: loss {history['train_loss'][-1]:.3f}, "
        f"train acc {history['train_acc'][-1]:.3f}, "
        f"test acc {history['test_acc'][-1]:.3f}, "
        f"{history['epoch_seconds'][-1]:.1f} s, "
        f"{history['examples_per_second'][-1]:.0f} examples/s "
        f"({ctx.world_size if ctx else 1} rank(s), {ctx.backend if ctx else 'no process group'})"
    )


def train_ddp(
    cfg: DDPConfig,
    ctx: DistContext | None = None,
    data: Tensors4 | None = None,
    device: torch.device | None = None,
) -> DDPResult:
    """Train ``cfg.model`` with DDP inside the process group ``ctx`` (chapter 5).

    ``ctx=None`` trains in this one process without a process group or DDP,
    with the same sampler, seed and batches as a one-rank job: the baseline
    that DDP must reproduce. ``data`` replaces Fashion-MNIST (tests use small
    synthetic tensors). ``device`` defaults to ``ctx.device`` (CPU without ctx).
    """
    world_size, rank = _check_train_args(cfg, ctx, data, device)
    is_main = rank == 0
    device = device or (ctx.device if ctx is not None else torch.device("cpu"))

    # The snapshot first: a run that cannot continue from it fails before loading any data.
    snapshot_path = Path(cfg.snapshot) if cfg.snapshot else None
    snapshot = _load_snapshot(snapshot_path, ctx)
    if snapshot is not None:
        assert snapshot_path is not None
        _check_resumable(snapshot, cfg, snapshot_path)

    sampler, train_loader, test_loader = _make_loaders(
        cfg, data if data is not None else _load_tensors(cfg), rank, world_size
    )
    torch.manual_seed(cfg.seed)  # the same initial weights everywhere
    model = build_model(cfg.model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    history: dict[str, list[float]] = {k: [] for k in _HISTORY_KEYS}
    start_epoch = 0
    start_loss = None  # the job's first step's loss: the divergence rule measures from it
    if snapshot is not None:
        assert snapshot_path is not None
        start_epoch, history = _resume(
            snapshot, model, optimizer, cfg, snapshot_path, is_main and cfg.log
        )
        start_loss = snapshot.get("start_loss")

    # DDP registers hooks that all-reduce gradient buckets while backward is still running.
    net: nn.Module = model
    if ctx is not None:
        net = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    policy = precision_policy(device, cfg.precision)
    scaler = policy.make_scaler()
    if snapshot is not None and snapshot.get("scaler"):
        scaler.load_state_dict(snapshot["scaler"])
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
            _record_epoch(history, stats, time.perf_counter() - started, epoch, cfg,
                          len(train_loader), start_loss)
            if is_main and cfg.log:
                print(_epoch_line(history, epoch, cfg, ctx), flush=True)
            if is_main and snapshot_path is not None:
                _save_snapshot(snapshot_path, {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),  # empty unless fp16 scales the loss
                    "epochs_done": epoch + 1,
                    "history": history,
                    "start_loss": start_loss,
                    "config": _recorded_config(cfg),
                })
            if ctx is not None:
                mark_progress(f"barrier after epoch {epoch + 1}")
                dist.barrier()  # nobody moves on (or fails, below) before the snapshot is on disk
            _maybe_fail(cfg, epoch + 1, rank, world_size)

    return DDPResult(
        world_size=world_size,
        backend=ctx.backend if ctx is not None else "none",
        resumed_from_epoch=start_epoch,
        device=str(device),
        state_dict={k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        **history,
    )


def _check_data(data: object) -> None:
    """``data`` must be (train images, train labels, test images, test labels), finite."""
    if not (
        isinstance(data, (tuple, list))
        and len(data) == 4
        and all(isinstance(t, torch.Tensor) for t in data)
    ):
        raise TypeError(
            "data must be a tuple of 4 tensors (train images, train labels, test images, "
            f"test labels), or None for Fashion-MNIST; got {type(data).__name__}"
        )
    for name, images, labels in (("train", data[0], data[1]), ("test", data[2], data[3])):
        if len(images) == 0:
            raise ValueError(f"the {name} set is empty (0 {name} images): pass at least one "
                             f"example per rank")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} {name} images but {len(labels)} {name} labels")
        if images.is_floating_point() and not torch.isfinite(images).all():
            raise ValueError(f"the {name} images hold nan or inf: clean the data before training")
        if labels.is_floating_point() or labels.is_complex():
            raise TypeError(f"the {name} labels must be integer class indices, got {labels.dtype}")


def _count_correct(
    net: nn.Module, loader: DataLoader, device: torch.device, policy: PrecisionPolicy
) -> tuple[int, int]:
    net.eval()
    correct = seen = 0
    with torch.no_grad():
        for X, y in loader:
            X, y = X.to(device), y.to(device)
            with policy.autocast():
                logits = net(X)
            correct += int((logits.argmax(dim=1) == y).sum())
            seen += len(y)
    return correct, seen


def _maybe_fail(cfg: DDPConfig, epochs_done: int, rank: int, world_size: int) -> None:
    """Simulate a crashed worker once, to show that a restarted job resumes from its snapshot."""
    if cfg.fail_after_epoch != epochs_done or rank != world_size - 1:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return  # already restarted: the failure happened on an earlier attempt
    raise RuntimeError(
        f"simulated failure of rank {rank} after epoch {epochs_done} (--fail-after-epoch)"
    )


def ddp_worker(
    rank: int,
    world_size: int,
    master_port: int,
    cfg: DDPConfig,
    data: Tensors4 | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DDPResult:
    """Entry point for :func:`d2lgpu.runtime.distributed.launch`: join the group, train, leave
    (chapter 5)."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=timeout_s) as ctx:
        return train_ddp(cfg, ctx, data)


def _parse_args(argv: Sequence[str] | None) -> tuple[DDPConfig, float]:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m d2lgpu.ddp_train",
        description="Train on Fashion-MNIST with DistributedDataParallel.",
    )
    parser.add_argument(
        "--epochs",
        type=positive_int_flag,
        default=DDPConfig.epochs,
        help="total epochs, including those a snapshot already holds (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int_flag,
        default=DDPConfig.batch_size,
        help="global batch size, split evenly over the ranks (default %(default)s)",
    )
    parser.add_argument("--lr", type=positive_number_flag, default=DDPConfig.lr)
    parser.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="default: small_cnn in quick mode, resnet18 otherwise",
    )
    parser.add_argument(
        "--snapshot",
        default=None,
        help="resume from this file if it exists, and rewrite it after every epoch",
    )
    parser.add_argument("--seed", type=seed_flag, default=DDPConfig.seed)
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=DDPConfig.precision,
        help="fp32 (strict, the default), tf32, fp16 (with loss scaling), bf16, or auto: the "
        "device's fast format (d2lgpu.precision_policy)",
    )
    add_job_flags(parser, crash_point="this epoch")
    args = parser.parse_args(argv)
    quick = small_data() if args.quick is None else args.quick
    try:
        cfg = DDPConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            model=args.model or ("small_cnn" if quick else "resnet18"),
            data_root=args.data_root,
            snapshot=args.snapshot,
            seed=args.seed,
            quick=quick,
            fail_after_epoch=args.fail_after_epoch,
            precision=args.precision,
        )
    except ValueError as exc:  # the flags were checked above; this is a safety net
        parser.error(str(exc))
    return cfg, args.timeout


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
            print(
                f"{ctx.world_size} ranks, backend {ctx.backend}, model {cfg.model}, "
                f"global batch {cfg.batch_size} ({cfg.batch_size // ctx.world_size} per rank)",
                flush=True,
            )
        result = train_ddp(cfg, ctx)
        if ctx.is_main:
            print(
                f"done: {result.num_epochs} epochs, final test acc {result.test_acc[-1]:.3f}",
                flush=True,
            )
        return result


def command_line(argv: Sequence[str] | None = None) -> int:
    """:func:`main` as ``python -m d2lgpu.ddp_train`` runs it; returns the exit status.

    0 when the run finished (or had nothing left to train). 1 when it failed:
    for a snapshot it cannot continue from, or a loss that stopped being
    finite, the message alone (the traceback would add nothing); for anything
    else the traceback. Bad flags end in ``main`` with argparse's usage error
    (``SystemExit(2)``).
    """
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
