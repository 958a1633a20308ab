"""Sharded data parallelism with FSDP2: every rank keeps 1/N of the model, and what that costs.

DDP (chapter 5) keeps a full copy of the parameters, gradients and optimizer
state on every rank. FSDP2 (``fully_shard``) keeps a 1/N slice of each on each
rank, as a ``DTensor`` sharded along dimension 0, and assembles a layer's full
parameters only while that layer computes: an **all-gather** before its
forward (and again before its backward, unless ``reshard_after_forward=False``
keeps them), a **reduce-scatter** of its gradients after its backward, so each
rank receives the averaged gradient of its own slice. The optimizer then
updates slices only.

This module holds what chapter 8 runs on every rank: :func:`shard_model`
(``fully_shard`` on each block, then on the root), :func:`train_fsdp` (a short
run, the same computation as :func:`train_single` in one process), counting of
collectives (:class:`CollectiveCounter` for FSDP's, :func:`counting_allreduce_hook`
for DDP's), and distributed checkpoints (:func:`save_checkpoint`,
:func:`load_checkpoint`) that a different number of ranks, or one process, can
load. :func:`sharding_worker` is the entry point for
:func:`d2lgpu.runtime.distributed.launch`; it runs a list of jobs (:class:`FSDPRun`,
:class:`AccumulationRun`) in one launch.

FSDP2 is ``torch.distributed.fsdp.fully_shard`` from torch 2.6 on and
``torch.distributed._composable.fsdp.fully_shard`` in 2.4 and 2.5; those two
versions run it on CUDA only. On a CPU (gloo) it needs torch 2.9 or newer:
up to 2.8 its reduce-scatter over gloo sums the gradients instead of averaging
them, so N ranks train with N times the learning rate
(:func:`fsdp2_unavailable_reason` says so). The older ``FullyShardedDataParallel``
(FSDP1) flattens parameters and refuses to run without an accelerator.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from d2lgpu.memory import OPTIMIZERS, make_optimizer, storage_bytes
from d2lgpu.models import MLPBlock, residual_mlp
from d2lgpu.precision import check_precision, precision_policy
from d2lgpu.runtime.checks import (
    check_bool,
    check_module,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_tensor,
    check_training_loss,
)
from d2lgpu.runtime.distributed import DEFAULT_TIMEOUT_S, DistContext, process_group

try:  # public from torch 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 and 2.5
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # older than 2.4: no FSDP2
        MixedPrecisionPolicy = None  # type: ignore[assignment,misc]
        fully_shard = None  # type: ignore[assignment]
try:  # public from torch 2.5
    from torch.distributed.tensor import DTensor
except ImportError:
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

__all__ = [
    "ACCUMULATION_VARIANTS",
    "FSDP2_CPU_MIN_TORCH",
    "AccumulationResult",
    "CheckpointError",
    "CollectiveCounter",
    "CommStats",
    "FSDPResult",
    "FSDPRun",
    "SingleResult",
    "StepWatch",
    "MLPShape",
    "ShardInfo",
    "TrainPlan",
    "collective_formula",
    "counting_allreduce_hook",
    "AccumulationRun",
    "check_resumable",
    "describe_shards",
    "fsdp2_unavailable_reason",
    "fsdp_param_dtype",
    "prepare_checkpoint_root",
    "sharding_worker",
    "latest_checkpoint",
    "newest_intact_checkpoint",
    "read_checkpoint_extra",
    "load_checkpoint",
    "local_bytes",
    "padded_parameter_bytes",
    "save_checkpoint",
    "shard_model",
    "train_fsdp",
    "train_single",
    "unsharded_parameter_bytes",
]

#: The first torch whose FSDP2 trains correctly on a CPU device mesh (2.6 stopped creating
#: CUDA streams there; 2.9 averages gradients over gloo instead of summing them).
FSDP2_CPU_MIN_TORCH = (2, 9)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def fsdp2_unavailable_reason(device_type: str = "cpu") -> str | None:
    """Why FSDP2 cannot run here on ``device_type`` (``"cpu"`` or ``"cuda"``); None when it can
    (chapter 8)."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda' (a torch.device's .type), "
                         f"got {device_type!r}")
    if fully_shard is None:
        return f"FSDP2 (fully_shard) needs torch >= 2.4; this is torch {torch.__version__}"
    if device_type == "cpu" and _torch_version() < FSDP2_CPU_MIN_TORCH:
        return (
            "FSDP2 on a CPU device mesh (gloo) needs torch >= 2.9: before 2.6 it used CUDA "
            "streams unconditionally, and up to 2.8 its reduce-scatter on gloo summed the "
            "gradients instead of averaging them (pytorch/pytorch#162338); this is torch "
            f"{torch.__version__}"
        )
    return None


# ---------------------------------------------------------------------------
# The model and a short, exactly repeatable training run
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MLPShape:
    """The size of a :func:`d2lgpu.models.residual_mlp` (chapter 8)."""

    width: int = 256
    hidden: int = 1024
    depth: int = 4
    in_features: int = 784
    num_classes: int = 10

    def __post_init__(self) -> None:
        for name in ("width", "hidden", "depth", "in_features", "num_classes"):
            check_positive_int(name, getattr(self, name))

    def build(self, seed: int = 0) -> nn.Sequential:
        """The model with the initial weights of ``seed``: the same on every rank."""
        torch.manual_seed(seed)
        return residual_mlp(self.width, self.hidden, self.depth, self.in_features, self.num_classes)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.build().parameters())


@dataclass(frozen=True)
class TrainPlan:
    """A training run defined down to the last example, so runs can be compared number for number
    (chapter 8).

    Step ``s`` uses the global batch of examples ``s*B .. s*B+B-1`` of its
    epoch's order (in order, or a seeded shuffle per epoch); with ``W`` ranks,
    rank ``r`` takes the ``r``-th of ``W`` equal consecutive slices of it.
    Every rank's loss is the mean over its slice, and data-parallel training
    averages the ranks' gradients, so the update is the one of the mean over
    the whole batch, whatever ``W`` is.
    """

    shape: MLPShape
    images: torch.Tensor
    labels: torch.Tensor
    batch_size: int
    steps: int
    lr: float = 1e-3
    optimizer: str = "adam"
    seed: int = 0
    #: Shuffle the data anew every epoch (seeded); otherwise take them in order.
    shuffle: bool = False
    #: Optional held-out data, for the accuracy that :func:`train_fsdp` logs.
    test_images: torch.Tensor | None = None
    test_labels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.shape, MLPShape):
            raise TypeError(f"shape must be an MLPShape, got {type(self.shape).__name__}")
        check_tensor("images", self.images)
        check_tensor("labels", self.labels)
        check_positive_int("batch_size", self.batch_size)
        check_positive_int("steps", self.steps)
        check_positive_float("lr", self.lr)
        check_seed(self.seed)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {tuple(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {self.shuffle!r}")
        for name in ("images", "test_images"):
            value = getattr(self, name)
            if value is not None and value.is_floating_point() and not value.isfinite().all():
                raise ValueError(
                    f"{name} hold nan or inf: training on them can only give nan; "
                    "find the broken examples with (~images.isfinite()).flatten(1).any(1)"
                )
        if len(self.images) != len(self.labels):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels")
        if (self.test_images is None) != (self.test_labels is None):
            raise ValueError("pass both test_images and test_labels, or neither")

    @property
    def steps_per_epoch(self) -> int:
        """Full batches in one pass over the data (a last, partial batch is left out)."""
        return max(len(self.labels) // self.batch_size, 1)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples of step ``step``: the same whatever the number of ranks."""
        epoch, position = divmod(step, self.steps_per_epoch)
        if self.shuffle:  # a new order every epoch, from the seed and the epoch number
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.labels), generator=gen)
        else:
            order = torch.arange(len(self.labels))
        idx = order[(position * self.batch_size + torch.arange(self.batch_size)) % len(order)]
        X = self.images[idx]
        X = X.float() / 255 if X.dtype == torch.uint8 else X.float()
        return X, self.labels[idx]

    def local_batch(
        self, step: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_size % world_size:
            raise ValueError(
                f"the global batch of {self.batch_size} does not split evenly over {world_size} "
                f"ranks: use a multiple of {world_size}"
            )
        X, y = self.global_batch(step)
        local = self.batch_size // world_size
        return X[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model state on the CPU; a collective under FSDP (every rank must call it)."""
    state = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        state[name] = value.detach().float().cpu().clone()
    return state


@dataclass
class SingleResult:
    """A run in one process: the loss of every step and the final weights."""

    losses: list[float]
    state_dict: dict[str, torch.Tensor]


def train_single(plan: TrainPlan, device: torch.device | str = "cpu") -> SingleResult:
    """``plan`` in this one process on the whole batch: the baseline sharded runs must match
    (chapter 8)."""
    if not isinstance(plan, TrainPlan):
        raise TypeError(f"plan must be a TrainPlan, got {type(plan).__name__}")
    device = torch.device(device)
    model = plan.shape.build(plan.seed).to(device)
    optimizer = make_optimizer(plan.optimizer, model.parameters(), lr=plan.lr)
    losses = []
    for step in range(plan.steps):
        X, y = (t.to(device) for t in plan.global_batch(step))
        loss = nn.functional.cross_entropy(model(X), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        _check_losses(losses, step, plan)
    return SingleResult(losses, _cpu_state(model))


# ---------------------------------------------------------------------------
# Sharding, and looking at the shards
# ---------------------------------------------------------------------------


def _require_fsdp2(device_type: str) -> None:
    reason = fsdp2_unavailable_reason(device_type)
    if reason is not None:
        raise RuntimeError(reason)


def fsdp_param_dtype(
    device: torch.device | str,
    precision: str,
    capability: tuple[int, int] | None = None,
) -> torch.dtype | None:
    """The dtype FSDP2's layers compute in on ``device`` for ``precision``; None for fp32.

    ``precision`` is a word of :data:`d2lgpu.precision.PRECISIONS`, read by the
    course's one rule, :func:`d2lgpu.precision.precision_policy`: "auto" is bf16
    from compute capability 8.0, fp16 on 7.x, where bf16 is emulated and slow, and
    on a CPU bf16 where it runs natively, fp32 elsewhere; "bf16"/"fp16" force one;
    "fp32" and "tf32" keep the layers in fp32 (TF32 only changes how CUDA rounds
    fp32 matmuls: :func:`train_fsdp` switches it). ``capability`` overrides the
    GPU's own (for tests and GPUs you do not have).
    """
    return precision_policy(device, precision, capability=capability).dtype


def shard_model(
    model: nn.Module,
    mesh: Any,
    *,
    reshard_after_forward: bool = True,
    precision: str = "fp32",
) -> nn.Module:
    """``fully_shard`` every :class:`~d2lgpu.models.MLPBlock`, then the whole model, in place.

    Bottom-up, as FSDP2 requires: each block becomes one communication group
    (one all-gather, one reduce-scatter), and the root call takes the
    parameters left over (the first and last linear layers). A ``precision`` of
    "bf16" or "fp16" (or "auto" where the device's rule picks one: see
    :func:`fsdp_param_dtype`) computes with bf16 or fp16 copies of the parameters
    and reduces gradients in fp32; the sharded parameters and the optimizer stay fp32.
    """
    check_module("model", model)
    if not hasattr(mesh, "device_type"):
        raise TypeError(
            "mesh must be a DeviceMesh: init_device_mesh(device_type, (world_size,)), "
            f"got {type(mesh).__name__}"
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"reshard_after_forward must be True or False, got {reshard_after_forward!r}"
        )
    _require_fsdp2(mesh.device_type)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    param_dtype = fsdp_param_dtype(mesh.device_type, precision)
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32
        )
    for module in model.modules():
        if isinstance(module, MLPBlock):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


@dataclass(frozen=True)
class ShardInfo:
    """One parameter as this rank holds it."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: str


def describe_shards(model: nn.Module) -> list[ShardInfo]:
    """Name, full shape, this rank's shape and the placement of every parameter."""
    check_module("model", model)
    rows = []
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            local, placements = param.to_local(), str(tuple(param.placements))
        else:
            local, placements = param, "(not sharded)"
        rows.append(ShardInfo(name, tuple(param.shape), tuple(local.shape), placements))
    return rows


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(tensors: Sequence[torch.Tensor] | Iterator[torch.Tensor]) -> int:
    """Bytes this rank stores for ``tensors``: the local shard of a DTensor, padding included."""
    if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__iter__"):
        raise TypeError(
            f"tensors must be an iterable of tensors (e.g. model.parameters()), got "
            f"{type(tensors).__name__}"
        )
    return storage_bytes(_local(t) for t in tensors if t is not None)


def unsharded_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters currently held unsharded (full) on this rank.

    Between forward and backward that is what ``reshard_after_forward=False``
    keeps: the full parameters of every group, ready for backward.
    """
    check_module("model", model)
    return storage_bytes(p for p in model.parameters() if not isinstance(p, DTensor))


def padded_parameter_bytes(model: nn.Module, world_size: int) -> int:
    """Bytes of ``model``'s parameters once FSDP2 pads dim 0 to a multiple of ``world_size``.

    A tensor of ``n`` rows is cut into ``world_size`` chunks of ``ceil(n / N)``
    rows (the last ones may be shorter or empty), and each rank's chunk is
    padded to that size so that all-gathers move equal pieces.
    """
    check_module("model", model)
    check_positive_int("world_size", world_size)
    total = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // max(rows, 1)
        total += math.ceil(rows / world_size) * world_size * per_row * p.element_size()
    return total


# ---------------------------------------------------------------------------
# Counting communication
# ---------------------------------------------------------------------------

_COLLECTIVE_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
}


@dataclass
class CommStats:
    """Collective calls and the bytes they carried (the full, unsharded size of each)
    (chapter 8)."""

    calls: int = 0
    nbytes: int = 0
    dtypes: set[str] = field(default_factory=set)

    def add(self, nbytes: int, dtype: torch.dtype | None = None) -> None:
        self.calls += 1
        self.nbytes += nbytes
        if dtype is not None:
            self.dtypes.add(str(dtype).replace("torch.", ""))


def _payload(args: tuple[Any, ...]) -> tuple[int, torch.dtype | None]:
    """The size of a collective: its largest tensor argument (list arguments summed).

    For an all-gather that is the gathered output, for a reduce-scatter the
    input before scattering, for an all-reduce the tensor itself: the full size.
    """
    best, dtype = 0, None
    for arg in args:
        tensors = [t for t in tree_flatten(arg)[0] if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes > best:
            best, dtype = nbytes, tensors[0].dtype
    return best, dtype


class CollectiveCounter(TorchDispatchMode):
    """Count the collectives this process issues inside a ``with`` block, by kind.

    torch.distributed's collectives are operators of the ``c10d`` namespace,
    dispatched like any other, so a dispatch mode sees each one: FSDP2's
    all-gathers and reduce-scatters included, also those its hooks issue during
    backward. ``stats["all_gather"].nbytes`` is the total payload.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, CommStats] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0]
            if name in _COLLECTIVE_KINDS or "gather" in name or "reduce" in name:
                kind = _COLLECTIVE_KINDS.get(name, name)
                self.stats.setdefault(kind, CommStats()).add(*_payload(args))
        return func(*args, **(kwargs or {}))


def collective_formula(
    model: nn.Module, world_size: int, *, reshard_after_forward: bool, precision: str
) -> dict[str, int]:
    """Predicted payload bytes of one FSDP2 training step, by kind of collective.

    Every group's parameters are all-gathered before its forward, and again
    before its backward when they were resharded after forward; its gradients
    are reduce-scattered once. All of it at the padded size (see
    :func:`padded_parameter_bytes`), the all-gathers in the dtype the layers compute
    in (``precision`` "bf16" or "fp16": 2 bytes; "fp32" or "tf32": 4) and the
    reduction in fp32. "auto" depends on the device: pass the word it resolved to.
    """
    check_bool("reshard_after_forward", reshard_after_forward)
    if check_precision(precision) == "auto":
        raise ValueError(
            "collective_formula needs the precision the layers computed in, not 'auto': pass "
            "'bf16' or 'fp16' when fsdp_param_dtype(device, 'auto') gave one, else 'fp32'"
        )
    padded = padded_parameter_bytes(model, world_size)
    gathers = 2 if reshard_after_forward else 1
    gather_bytes = padded // 2 if precision in ("bf16", "fp16") else padded
    return {"all_gather": gathers * gather_bytes, "reduce_scatter": padded}


def counting_allreduce_hook(stats: CommStats, bucket: dist.GradBucket) -> torch.futures.Future:
    """A DDP communication hook: average a gradient bucket like DDP does, and count it (chapter 8).

    Register with ``ddp_model.register_comm_hook(CommStats(), counting_allreduce_hook)``.
    DDP calls it once per bucket whenever gradients are synchronised.
    """
    buffer = bucket.buffer()
    stats.add(buffer.numel() * buffer.element_size(), buffer.dtype)
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks a hook's annotations against the objects themselves; this module's
# annotations are strings (``from __future__ import annotations``), so set the objects.
counting_allreduce_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
)


# ---------------------------------------------------------------------------
# Distributed checkpoints
# ---------------------------------------------------------------------------

_STEP_PREFIX = "step-"
_CHECKSUMS = "checksums.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, trusted, or continued from under this run's settings."""


def _start_fresh(root: Path) -> str:
    return f"to start fresh, delete {root} or pass another checkpoint directory"


def prepare_checkpoint_root(root: str | Path) -> Path:
    """Create ``root`` if needed and make sure files can be written there; return it.

    Called before training, so that a directory under a regular file, or on a
    file system that takes no files (``/proc``), fails at once and not after the
    first epoch's work.
    """
    if not isinstance(root, (str, os.PathLike)) or str(root) == "":
        raise TypeError(f"the checkpoint directory must be a path, got {root!r}")
    root = Path(root)
    for ancestor in (root, *root.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise CheckpointError(
                    f"cannot write checkpoints to {root}: {ancestor} is a file, not a "
                    "directory; pass a checkpoint directory elsewhere"
                )
            break
    probe = root / f".write-test-{os.uname().nodename}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"d2lgpu")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"cannot write checkpoints to {root} ({exc.strerror or exc}); pass a checkpoint "
            "directory on a file system you can write to"
        ) from None
    return root


def _file_digests(directory: Path) -> dict[str, str]:
    """SHA-256 of every file in a checkpoint directory but the list of digests itself."""
    digests = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != _CHECKSUMS:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            digests[path.name] = digest.hexdigest()
    return digests


def _checkpoint_damage(path: Path) -> str | None:
    """What is wrong with the checkpoint directory ``path``, or None when it is intact.

    Intact means: DCP's ``.metadata`` is there, and every file matches the SHA-256 that
    :func:`save_checkpoint` wrote with it in ``checksums.json``, no file missing or added.
    """
    if not (path / ".metadata").exists():
        return "has no .metadata (the map of its shards): it was damaged after it was written"
    listed = path / _CHECKSUMS
    if not listed.is_file():
        return (f"has no {_CHECKSUMS}, so its files cannot be checked: it was not written by "
                "save_checkpoint, or was damaged")
    try:
        expected = json.loads(listed.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return f"has a {_CHECKSUMS} that is not readable JSON: it was damaged"
    if not isinstance(expected, dict):
        return f"has a {_CHECKSUMS} that holds no list of files: it was damaged"
    actual = _file_digests(path)
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            problem = "is missing"
        elif name not in expected:
            problem = "was not part of the checkpoint when it was written"
        elif actual[name] != expected[name]:
            problem = ("is empty" if (path / name).stat().st_size == 0 else
                       "does not match the checksum written with it (corrupt or changed)")
        else:
            continue
        return f"file {name} {problem}"
    return None


def _step_of(path: Path) -> int | None:
    """The step of a checkpoint directory named ``step-NNNNNN``, else None."""
    digits = path.name[len(_STEP_PREFIX):]
    if path.name.startswith(_STEP_PREFIX) and digits.isdigit() and path.is_dir():
        return int(digits)
    return None


def newest_intact_checkpoint(root: str | Path, before: int | None = None) -> Path | None:
    """The checkpoint of the highest step under ``root`` whose files all check out.

    ``before`` limits it to steps below that one (the checkpoints older than a damaged
    one). None when there is none: then the only way on is to start fresh.
    """
    steps = sorted(
        ((step, p) for p in Path(root).iterdir() if (step := _step_of(p)) is not None),
        reverse=True,
    ) if Path(root).is_dir() else []
    for step, candidate in steps:
        if (before is None or step < before) and _checkpoint_damage(candidate) is None:
            return candidate
    return None


def _verify_checkpoint(path: Path) -> None:
    """Compare every file of a checkpoint with the digests written with it.

    A damaged checkpoint is refused with what is wrong (the file, and how) and the way
    on: the newest intact checkpoint before it, when there is one, or starting fresh.
    """
    damage = _checkpoint_damage(path)
    if damage is None:
        return
    fresh = _start_fresh(path.parent)
    step = _step_of(path)
    older = newest_intact_checkpoint(path.parent, before=step) if step is not None else None
    if older is not None:
        way_on = (f"Delete {path} to resume from {older.name}, the newest intact checkpoint "
                  f"before it; or, {fresh}")
    else:
        way_on = f"No intact checkpoint comes before it: {fresh}"
    raise CheckpointError(f"checkpoint {path} {damage}. {way_on}")


def read_checkpoint_extra(path: str | Path) -> dict[str, Any]:
    """The ``extra.json`` of a checkpoint (its step, losses, settings), after checking
    every file of it against its checksums.

    Damage is named as such (:class:`CheckpointError`: which file, and the newest intact
    checkpoint to resume from instead), never taken for a checkpoint without settings.
    """
    path = Path(path)
    _verify_checkpoint(path)
    try:
        extra = json.loads((path / "extra.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError) as exc:  # only if written so
        raise CheckpointError(
            f"checkpoint {path}'s extra.json (its step, losses and settings, written by "
            f"d2lgpu's save_checkpoint) cannot be read ({exc}); {_start_fresh(path.parent)}"
        ) from None
    if not isinstance(extra, dict) or not isinstance(extra.get("step"), int):
        raise CheckpointError(
            f"checkpoint {path}'s extra.json holds no step number: it was not written by "
            f"save_checkpoint; {_start_fresh(path.parent)}"
        )
    return extra


_SINGLE_PROCESS_WARNING = r"torch\.distributed is .*(unavailable|uninitialized)"


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process; here it is meant.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _dcp():
    # Imported on first use: torch.distributed.checkpoint takes a while to import.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write model and optimizer to ``root/step-NNNNNN`` with torch.distributed.checkpoint.

    Every rank of the job calls it (it is a collective) and writes its own
    shards; rank 0 writes the metadata that maps shards to tensors, and
    ``extra`` (small JSON-able data, e.g. the loss history) as ``extra.json``.
    Everything goes to a hidden temporary directory first, which rank 0 renames
    to its final name once every rank has finished writing: a directory called
    ``step-*`` is always complete, and a crash mid-write leaves only a
    temporary directory that :func:`latest_checkpoint` ignores. Rank 0 also
    writes the SHA-256 of every file (``checksums.json``), which
    :func:`load_checkpoint` verifies. Across machines, ``root`` must be on a file
    system they share.
    """
    check_module("model", model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    dcp, get_state_dict, _ = _dcp()
    root = prepare_checkpoint_root(root) if _is_main() else Path(root)
    final = root / f"{_STEP_PREFIX}{step:06d}"
    tmp = root / f".{final.name}.tmp"
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
        tmp.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_quietly():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    if _is_main():
        (tmp / "extra.json").write_text(json.dumps({"step": step, **(extra or {})}))
        (tmp / _CHECKSUMS).write_text(json.dumps(_file_digests(tmp), indent=1))
        if final.exists():  # the same step saved again after a restart: replace it
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)  # atomic: the name appears only when complete
    _barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint of the highest step under ``root``, or None when there is none (chapter 8).

    None only for a directory with nothing that looks like a checkpoint: temporary
    directories of a save that crashed (``.step-NNNNNN.tmp``) do not count. A
    ``step-*`` directory without ``.metadata`` is an error, not a missing checkpoint:
    such a name appears only once the save is complete, so it was damaged later, and
    silently starting over would throw the training away. Entries that look like
    checkpoints but are not one (``step-abc``, ``step-1.tmp``, a file named
    ``step-000003``) are an error when they are all there is, and a warning beside real
    checkpoints: a resumed run must never start from scratch without a word.
    """
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path, got {type(root).__name__} {root!r}")
    root = Path(root)
    if not root.is_dir():
        return None
    done, lookalikes = [], []
    for p in root.iterdir():
        if _step_of(p) is not None:
            done.append(p)
        elif p.name.startswith(_STEP_PREFIX) or p.name.endswith(".distcp"):
            lookalikes.append(p.name)
    for p in done:
        if not (p / ".metadata").exists():
            _verify_checkpoint(p)  # raises, naming the newest intact one before it
    if lookalikes:
        odd = ", ".join(sorted(lookalikes)[:5]) + (" ..." if len(lookalikes) > 5 else "")
        what = (f"{root} holds {len(lookalikes)} entr{'y' if len(lookalikes) == 1 else 'ies'} "
                f"that look like checkpoints but are not ({odd}): save_checkpoint writes "
                f"directories named {_STEP_PREFIX}NNNNNN (six digits)")
        if not done:
            raise CheckpointError(
                f"{what}, and there is no other checkpoint, so a resumed run would start from "
                f"scratch. Rename or move them away if they are checkpoints of another tool; "
                f"or, {_start_fresh(root)}"
            )
        warnings.warn(f"{what}; they are left out", stacklevel=2)
    return max(done, key=lambda p: int(p.name[len(_STEP_PREFIX):]), default=None)


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint` into ``model`` and ``optimizer``; return extra
    (chapter 8).

    ``model`` may be sharded over any number of ranks, or be a plain module in
    a process without a process group: DCP reads, for each tensor, the pieces
    of the saved shards that overlap what this rank holds (resharding).
    The files are first checked against the checksums written with them
    (:class:`CheckpointError` names the damaged file).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a checkpoint directory, got {type(path).__name__} {path!r}")
    check_module("model", model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    dcp, get_state_dict, set_state_dict = _dcp()
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is no checkpoint directory: pick one with latest_checkpoint()"
        )
    extra = read_checkpoint_extra(path)  # every file checked against its checksum first
    model_state, optim_state = get_state_dict(model, optimizer)
    _check_checkpoint_fits(path, model_state, dcp)
    state = {"model": model_state, "optim": optim_state}
    with _single_process_quietly():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return extra


def _check_checkpoint_fits(path: Path, model_state: dict[str, Any], dcp) -> None:
    """Refuse a checkpoint of another model before DCP does, naming what differs.

    DCP's own error is ``CheckpointException ranks:dict_keys([0])`` and a traceback; the
    checkpoint's ``.metadata`` already holds every tensor's full shape, so the parameter
    and both shapes can be named. Sharded parameters (DTensors) report their full shape.
    """
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    differences, missing = [], []
    for name, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            continue
        entry = saved.get(f"model.{name}")
        if entry is None:
            missing.append(name)
        elif hasattr(entry, "size") and tuple(entry.size) != tuple(value.shape):
            differences.append(f"{name} is {tuple(entry.size)} in the checkpoint, "
                               f"{tuple(value.shape)} in this model")
    if differences or missing:
        parts = differences + ([f"this model's {', '.join(missing[:5])} "
                                f"{'is' if len(missing) == 1 else 'are'} not in it"]
                               if missing else [])
        raise CheckpointError(
            f"checkpoint {path} holds another model: {'; '.join(parts[:6])}. Build the model "
            f"with the settings it was saved with (its extra.json records them); or, "
            f"{_start_fresh(path.parent)}"
        )


# ---------------------------------------------------------------------------
# Training with FSDP2
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FSDPRun:
    """One run of :func:`train_fsdp`: the plan, how to shard, and when to checkpoint (or fail)
    (chapter 8)."""

    plan: TrainPlan
    reshard_after_forward: bool = True
    #: A word of :data:`d2lgpu.precision.PRECISIONS`: "fp32" (strict; the default) or
    #: "tf32" (TF32 matmuls on CUDA) keep fp32 layers; "bf16" or "fp16" compute in
    #: that dtype (:func:`fsdp_param_dtype`); "auto" follows the device's rule.
    precision: str = "fp32"
    #: Where to write checkpoints (see :func:`save_checkpoint`), every ``save_every`` steps.
    checkpoint_root: str | None = None
    save_every: int | None = None
    #: A checkpoint directory to start from, or a root whose latest checkpoint to take
    #: (none there yet: start from step 0).
    resume_from: str | None = None
    #: Every this many steps, rank 0 prints the mean loss (and test accuracy, when the
    #: plan has test data).
    log_every: int | None = None
    #: For showing what a failure does: rank ``fail_rank`` raises in step ``fail_at_step``.
    fail_rank: int | None = None
    fail_at_step: int = 0

    def run(self, ctx: DistContext) -> FSDPResult:
        return train_fsdp(self, ctx)

    def __post_init__(self) -> None:
        if not isinstance(self.plan, TrainPlan):
            raise TypeError(f"plan must be a TrainPlan, got {type(self.plan).__name__}")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}"
            )
        check_precision(self.precision)
        for name in ("checkpoint_root", "resume_from"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise TypeError(f"{name} must be a directory path or None, got {value!r}")
        if self.save_every is not None and self.checkpoint_root is None:
            raise ValueError("save_every needs checkpoint_root, the directory to write to")
        for name in ("save_every", "log_every"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))


@dataclass
class StepWatch:
    """What one rank measured during the last step of a run."""

    #: Bytes of full (unsharded) parameters still held between forward and backward.
    held_after_forward: int = 0
    #: Bytes of this rank's gradient shards after backward.
    gradient_bytes: int = 0
    #: dtype of a block's weight while the block computes, and of the gradient shards.
    compute_dtype: str = "-"
    grad_dtype: str = "-"
    #: The CUDA allocator's peak during the step (None on CPUs).
    cuda_peak: int | None = None
    #: The collectives this rank issued in the step.
    comm: dict[str, CommStats] = field(default_factory=dict)


@dataclass
class FSDPResult:
    """What :func:`train_fsdp` returns on rank 0 (per-rank lists cover every rank)."""

    world_size: int
    backend: str
    #: The step the run started from (0, or the step of the checkpoint it resumed).
    start_step: int
    #: Mean loss over the global batch of every step, from step 0 (earlier ones come
    #: from the checkpoint when the run resumed).
    losses: list[float]
    #: (step, accuracy) at every log point when the plan has test data.
    test_acc: list[tuple[int, float]]
    #: Final full weights on the CPU.
    state_dict: dict[str, torch.Tensor]
    #: Rank 0's view of every parameter.
    shards: list[ShardInfo]
    #: Per rank: bytes of the local parameter shards and of the optimizer state.
    parameter_bytes: list[int]
    optimizer_bytes: list[int]
    #: Per rank: the measurements of the last step.
    watch: list[StepWatch]
    #: The formula's prediction of the last step's collectives.
    comm_formula: dict[str, int]
    #: Checkpoints written by this run.
    saved: list[str] = field(default_factory=list)
    #: The dtype the layers computed in ("float32" without mixed precision).
    param_dtype: str = "float32"


def _gather(value: Any, ctx: DistContext) -> list[Any]:
    values: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(values, value)
    return values


#: The word of :data:`d2lgpu.precision.PRECISIONS` for each dtype FSDP's layers compute in.
_PRECISION_OF: dict[torch.dtype | None, str] = {
    None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _watched_step(
    model: nn.Module,
    X: torch.Tensor,
    y: torch.Tensor,
    fail: str | None,
    scaler: Any = None,
) -> tuple[torch.Tensor, StepWatch]:
    """Forward and backward of one step, with the collectives counted and memory measured."""
    watch = StepWatch()
    block = next(m for m in model.modules() if isinstance(m, MLPBlock))

    def note_dtype(module: nn.Module, args: Any) -> None:
        watch.compute_dtype = _dtype_name(module.weight.dtype)

    hook = block.fc1.register_forward_pre_hook(note_dtype)
    if X.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(X.device)
    try:
        with CollectiveCounter() as counter:
            out = model(X)
            watch.held_after_forward = unsharded_parameter_bytes(model)
            if fail:
                raise RuntimeError(fail)
            loss = nn.functional.cross_entropy(out.float(), y)
            (loss if scaler is None else scaler.scale(loss)).backward()
    finally:
        hook.remove()
    watch.comm = counter.stats
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    watch.gradient_bytes = local_bytes(grads)
    watch.grad_dtype = _dtype_name(grads[0].dtype)
    if X.device.type == "cuda":
        watch.cuda_peak = torch.cuda.max_memory_allocated(X.device)
    return loss, watch


def _test_accuracy(model: nn.Module, plan: TrainPlan, ctx: DistContext) -> float:
    """Accuracy on the plan's test data; each rank takes one slice, counts are summed."""
    assert plan.test_images is not None and plan.test_labels is not None
    n = len(plan.test_labels)
    lo, hi = n * ctx.rank // ctx.world_size, n * (ctx.rank + 1) // ctx.world_size
    X = plan.test_images[lo:hi]
    X = (X.float() / 255 if X.dtype == torch.uint8 else X.float()).to(ctx.device)
    model.eval()
    with torch.no_grad():  # every rank runs one forward, so the all-gathers match up
        correct = (model(X).argmax(dim=1).cpu() == plan.test_labels[lo:hi]).sum().item()
    model.train()
    total = torch.tensor([correct], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return total.item() / n


#: What a checkpoint records of its run and a resumed run must repeat, with the words
#: that name each setting.
_MUST_MATCH = {
    "shape": "model shape (width, hidden, depth, in, classes)",
    "batch_size": "global batch size",
    "lr": "learning rate",
    "optimizer": "optimizer",
    "seed": "seed",
    "shuffle": "shuffle",
    "examples": "training examples",
    "precision": "precision",
    "param_dtype": "compute dtype",
}


def _recorded_config(run: FSDPRun, param_dtype: torch.dtype | None) -> dict[str, Any]:
    """The settings a checkpoint records, which a resumed run must share."""
    plan, shape = run.plan, run.plan.shape
    return {
        "shape": [shape.width, shape.hidden, shape.depth, shape.in_features, shape.num_classes],
        "batch_size": plan.batch_size,
        "lr": plan.lr,
        "optimizer": plan.optimizer,
        "seed": plan.seed,
        "shuffle": plan.shuffle,
        "examples": len(plan.labels),
        "precision": run.precision,
        "param_dtype": _dtype_name(param_dtype or torch.float32),
    }


def check_resumable(
    extra: dict[str, Any],
    config: dict[str, Any],
    path: Path,
    must_match: dict[str, str] | None = None,
) -> None:
    """Refuse a checkpoint written under other settings, naming every difference.

    ``must_match`` maps each setting of ``config`` to the words that name it (default:
    those of :func:`train_fsdp`).
    """
    old = extra.get("config")
    if not isinstance(old, dict):
        raise CheckpointError(
            f"checkpoint {path} does not record the settings it was trained with, so a resumed "
            f"run cannot be checked against them; {_start_fresh(path.parent)}"
        )
    differences = [
        f"{words} {old.get(key)} in the checkpoint, {config[key]} now"
        for key, words in (_MUST_MATCH if must_match is None else must_match).items()
        if old.get(key) != config[key]
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was written with other settings ({'; '.join(differences)}); "
            "resuming would continue its model and optimizer under the new ones. Rerun with the "
            f"checkpoint's settings; or, {_start_fresh(path.parent)}"
        )


def _resume(
    run: FSDPRun,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: DistContext,
    config: dict[str, Any],
) -> tuple[int, list[float]]:
    if run.resume_from is None:
        return 0, []
    path: Path | None = Path(run.resume_from)
    assert path is not None
    looks_like_one = path.name.startswith(_STEP_PREFIX) or any(path.glob("*.distcp"))
    if not (path / ".metadata").exists():
        if looks_like_one:
            _verify_checkpoint(path)  # raises: no .metadata
        path = latest_checkpoint(path)
    if path is None:
        return 0, []
    extra = read_checkpoint_extra(path)
    check_resumable(extra, config, path)
    if extra["step"] >= run.plan.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {extra['step']} and this run ends at step "
            f"{run.plan.steps}: nothing left to train. Ask for more steps (more epochs: they "
            f"count from the start, not from the checkpoint); or, {_start_fresh(path.parent)}"
        )
    extra = load_checkpoint(path, model, optimizer)
    if ctx.is_main and run.log_every:
        print(f"resuming from {path} (step {extra['step']})", flush=True)
    return extra["step"], list(extra.get("losses", []))


def _check_losses(losses: list[float], first_new: int, plan: TrainPlan) -> None:
    """Stop on a loss that is not finite, or far above the first step's: training diverged.

    The course's one divergence rule (:func:`d2lgpu.runtime.checks.check_training_loss`: not
    finite, or ten times the first step's loss) on every loss from index ``first_new`` on.
    """
    for step in range(first_new, len(losses)):
        if step == 0 and not math.isfinite(losses[0]):
            raise FloatingPointError(
                f"the loss of the very first step is {losses[0]}: before any update, so the "
                "initial weights hold nan or inf (the data were checked)"
            )
        check_training_loss(
            losses[step],
            when=f"step {step + 1}",
            lr=plan.lr,
            first_loss=losses[0] if step > 0 else None,
            advice=f"e.g. {plan.lr / 10:g}; stopped before writing a checkpoint",
        )


def train_fsdp(run: FSDPRun, ctx: DistContext) -> FSDPResult:
    """Train ``run.plan`` with FSDP2 over the ranks of ``ctx``; every rank calls it.

    The same seed gives the same full model on every rank, and ``fully_shard``
    keeps each rank's slice of it. The last step is watched
    (:class:`StepWatch`): collectives counted, full parameters held after
    forward measured, the CUDA peak read on GPUs. ``run.precision`` picks the
    dtype the layers compute in and, on CUDA, whether their fp32 matmuls may use TF32
    (:func:`d2lgpu.precision_policy`).
    """
    if not isinstance(run, FSDPRun):
        raise TypeError(f"run must be an FSDPRun, got {type(run).__name__}")
    plan = run.plan
    _require_fsdp2(ctx.device.type)
    if run.checkpoint_root is not None:
        prepare_checkpoint_root(run.checkpoint_root)  # before any training
    policy = precision_policy(ctx.device, run.precision)
    param_dtype = policy.dtype
    model = shard_model(
        plan.shape.build(plan.seed),
        _device_mesh(ctx),
        reshard_after_forward=run.reshard_after_forward,
        precision=run.precision,
    )
    optimizer = make_optimizer(plan.optimizer, model.parameters(), lr=plan.lr)
    scaler = _sharded_scaler(param_dtype, ctx)
    config = _recorded_config(run, param_dtype)
    start, losses = _resume(run, model, optimizer, ctx, config)
    pending: list[torch.Tensor] = []  # local losses not yet averaged over the ranks
    start_check = start  # losses before this index were checked already
    test_acc: list[tuple[int, float]] = []
    saved: list[str] = []
    watch = StepWatch()
    with policy.matmul_precision():  # TF32 on or off for fp32 matmuls (CUDA only)
        since = time.perf_counter()
        for step in range(start, plan.steps):
            X, y = (t.to(ctx.device) for t in plan.local_batch(step, ctx.rank, ctx.world_size))
            fail = None
            if run.fail_rank == ctx.rank and step == run.fail_at_step:
                fail = (
                    f"rank {ctx.rank} failed on purpose in step {step} (the others wait in "
                    "backward)"
                )
            loss, watched = _train_step(
                model, optimizer, scaler, X, y, watch=step == plan.steps - 1 or fail is not None,
                fail=fail,
            )
            if watched is not None:
                watch = watched
            pending.append(loss)

            done = step + 1
            log_now = run.log_every is not None and done % run.log_every == 0
            save_now = run.save_every is not None and done % run.save_every == 0
            if log_now or save_now:
                losses += _mean_over_ranks(pending, ctx)
                pending = []
                # On the means every rank shares, so all ranks stop together, before a save.
                _check_losses(losses, start_check, plan)
                start_check = len(losses)
            if log_now:
                line = f"step {done}/{plan.steps}: loss {losses[-1]:.4f}"
                if plan.test_images is not None:
                    test_acc.append((done, _test_accuracy(model, plan, ctx)))
                    line += f", test acc {test_acc[-1][1]:.3f}"
                line += f", {time.perf_counter() - since:.1f} s"
                since = time.perf_counter()
                if ctx.is_main:
                    print(line, flush=True)
            if save_now:
                extra = {"losses": losses, "world_size": ctx.world_size, "config": config}
                path = save_checkpoint(run.checkpoint_root or "", done, model, optimizer, extra)
                saved.append(str(path))
                if ctx.is_main and run.log_every:
                    print(f"saved checkpoint {path}", flush=True)
        losses += _mean_over_ranks(pending, ctx)
        _check_losses(losses, start_check, plan)

    return _fsdp_result(
        run, ctx, model, optimizer, start, losses, test_acc, saved, watch, param_dtype
    )


def _sharded_scaler(param_dtype: torch.dtype | None, ctx: DistContext) -> Any:
    """A ShardedGradScaler when the layers compute in fp16, None otherwise.

    fp16's narrow range lets small gradients underflow: scale the loss (chapter 6).
    The sharded scaler agrees over all ranks whether any gradient shard overflowed.
    """
    if param_dtype != torch.float16:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(ctx.device.type)


def _train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    watch: bool,
    fail: str | None,
) -> tuple[torch.Tensor, StepWatch | None]:
    """One optimizer step of the sharded model; returns this rank's loss (not yet averaged)
    and, for a watched step (:func:`_watched_step`), what was seen in it."""
    seen = None
    if watch:
        loss, seen = _watched_step(model, X, y, fail, scaler)
    else:
        loss = nn.functional.cross_entropy(model(X).float(), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is None:
        optimizer.step()
    else:  # skips the step where a gradient overflowed, on every rank alike
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), seen


def _fsdp_result(
    run: FSDPRun,
    ctx: DistContext,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    start: int,
    losses: list[float],
    test_acc: list[tuple[int, float]],
    saved: list[str],
    watch: StepWatch,
    param_dtype: torch.dtype | None,
) -> FSDPResult:
    """What :func:`train_fsdp` returns: the run, and every rank's memory and collectives."""
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    per_rank = _gather((local_bytes(model.parameters()), local_bytes(state), watch), ctx)
    return FSDPResult(
        world_size=ctx.world_size,
        backend=ctx.backend,
        start_step=start,
        losses=losses,
        test_acc=test_acc,
        state_dict=_cpu_state(model),
        shards=describe_shards(model),
        parameter_bytes=[r[0] for r in per_rank],
        optimizer_bytes=[r[1] for r in per_rank],
        watch=[r[2] for r in per_rank],
        comm_formula=collective_formula(
            run.plan.shape.build(),
            ctx.world_size,
            reshard_after_forward=run.reshard_after_forward,
            precision=_PRECISION_OF[param_dtype],  # what "auto" resolved to here
        ),
        saved=saved,
        param_dtype=_dtype_name(param_dtype or torch.float32),
    )


def _mean_over_ranks(local_losses: list[torch.Tensor], ctx: DistContext) -> list[float]:
    """Per-step mean loss over all ranks: one all-reduce for many steps."""
    if not local_losses:
        return []
    values = torch.stack(local_losses).double()
    dist.all_reduce(values)
    return (values / ctx.world_size).tolist()


def _device_mesh(ctx: DistContext) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world_size,))


def sharding_worker(
    rank: int,
    world_size: int,
    master_port: int,
    jobs: Sequence[FSDPRun | AccumulationRun],
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Entry point for :func:`d2lgpu.runtime.distributed.launch`: join the group, run
    ``jobs``, leave (chapter 8).

    Returns each job's result (an :class:`FSDPResult` or an
    :class:`AccumulationResult`). Several jobs share one launch, so that
    starting the processes, the slow part on a small machine, is paid once.
    """
    with process_group(rank, world_size, master_port=master_port, timeout_s=timeout_s) as ctx:
        return [job.run(ctx) for job in jobs]


# ---------------------------------------------------------------------------
# DDP with gradient accumulation: all-reduce every micro-batch, or only the last
# ---------------------------------------------------------------------------


@dataclass
class AccumulationResult:
    """Per variant: the all-reduces counted and the final weights."""

    micro_batches: int
    steps: int
    comm: dict[str, CommStats]
    state_dicts: dict[str, dict[str, torch.Tensor]]
    losses: dict[str, list[float]]


ACCUMULATION_VARIANTS = ("sync every micro-batch", "no_sync until the last")


def _train_ddp_accumulating(
    plan: TrainPlan, micro_batches: int, use_no_sync: bool, ctx: DistContext
) -> tuple[CommStats, dict[str, torch.Tensor], list[float]]:
    model = plan.shape.build(plan.seed).to(ctx.device)
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
    )
    stats = CommStats()
    ddp.register_comm_hook(stats, counting_allreduce_hook)
    optimizer = make_optimizer(plan.optimizer, ddp.parameters(), lr=plan.lr)
    losses = []
    for step in range(plan.steps):
        X, y = (t.to(ctx.device) for t in plan.local_batch(step, ctx.rank, ctx.world_size))
        total = torch.zeros((), device=ctx.device)
        parts = list(zip(X.chunk(micro_batches), y.chunk(micro_batches), strict=True))
        for i, (X_part, y_part) in enumerate(parts):
            last = i == len(parts) - 1
            # no_sync: backward only adds into .grad; the last backward all-reduces the sum.
            sync = contextlib.nullcontext() if last or not use_no_sync else ddp.no_sync()
            with sync:
                loss = nn.functional.cross_entropy(ddp(X_part), y_part) * (len(X_part) / len(X))
                loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return stats, _cpu_state(model), _mean_over_ranks(losses, ctx)


@dataclass(frozen=True)
class AccumulationRun:
    """DDP training of ``plan`` with ``micro_batches`` per step, both ways, all-reduces counted
    (chapter 8).

    Each rank splits its share of every global batch into ``micro_batches``
    pieces. A job for :func:`sharding_worker`.
    """

    plan: TrainPlan
    micro_batches: int

    def __post_init__(self) -> None:
        if not isinstance(self.plan, TrainPlan):
            raise TypeError(f"plan must be a TrainPlan, got {type(self.plan).__name__}")
        check_positive_int("micro_batches", self.micro_batches)

    def run(self, ctx: DistContext) -> AccumulationResult:
        comm, states, losses = {}, {}, {}
        for variant in ACCUMULATION_VARIANTS:
            use_no_sync = variant == ACCUMULATION_VARIANTS[1]
            stats, state, loss = _train_ddp_accumulating(
                self.plan, self.micro_batches, use_no_sync, ctx
            )
            comm[variant], states[variant], losses[variant] = stats, state, loss
        return AccumulationResult(self.micro_batches, self.plan.steps, comm, states, losses)
