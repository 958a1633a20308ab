"""Sharded data parallelism with FSDP2 (``fully_shard``): every rank keeps 1/N of the model
and counts the collectives it issues (chapter 8)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from d2lgpu.memory import check_optimizer, make_optimizer, storage_bytes
from d2lgpu.models import MLPBlock, residual_mlp
from d2lgpu.runtime.checks import (
    check_bool,
    check_finite_tensors,
    check_module,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_tensor,
    check_training_loss,
)
from d2lgpu.runtime.distributed import DEFAULT_TIMEOUT_S, DistContext, process_group


def fsdp2_unavailable_reason(device_type: str = "cpu") -> str | None:
    """Why FSDP2 cannot run here on ``device_type`` ("cpu" or "cuda"); None when it can
    (chapter 8)."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if device_type == "cpu" and version < (2, 9):
        return ("FSDP2 on a CPU device mesh (gloo) needs torch >= 2.9: up to 2.8 its "
                "reduce-scatter on gloo summed the gradients instead of averaging them "
                f"(pytorch/pytorch#162338); this is torch {torch.__version__}")
    return None


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
    """A training run fixed down to the last example, so that runs on any number of ranks can
    be compared number for number: rank r of W takes slice r of W of each batch (chapter 8)."""

    shape: MLPShape
    images: torch.Tensor
    labels: torch.Tensor
    batch_size: int
    steps: int
    lr: float = 1e-3
    optimizer: str = "adam"
    seed: int = 0
    shuffle: bool = False  # a new seeded order every epoch

    def __post_init__(self) -> None:
        if not isinstance(self.shape, MLPShape):
            raise TypeError(f"shape must be an MLPShape, got {type(self.shape).__name__}")
        check_tensor("images", self.images)
        check_tensor("labels", self.labels)
        check_positive_int("batch_size", self.batch_size)
        check_positive_int("steps", self.steps)
        check_positive_float("lr", self.lr)
        check_seed(self.seed)
        check_bool("shuffle", self.shuffle)
        check_optimizer(self.optimizer)
        fix = "Find the broken examples with (~images.isfinite()).flatten(1).any(1)"
        check_finite_tensors("images", [self.images], fix=fix)
        if len(self.images) != len(self.labels):
            raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels")

    @property
    def steps_per_epoch(self) -> int:
        return max(len(self.labels) // self.batch_size, 1)  # full batches only (drop_last)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples of step ``step``: the same whatever the number of ranks."""
        epoch, position = divmod(step, self.steps_per_epoch)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        n = len(self.labels)
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        idx = order[(position * self.batch_size + torch.arange(self.batch_size)) % n]
        return _as_float(self.images[idx]), self.labels[idx]

    def local_batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_size % world:
            raise ValueError(f"the global batch of {self.batch_size} does not split evenly over "
                             f"{world} ranks: use a multiple of {world}")
        X, y = self.global_batch(step)  # equal slices: the check above
        return X.chunk(world)[rank], y.chunk(world)[rank]


def _as_float(images: torch.Tensor) -> torch.Tensor:
    return images.float() / 255 if images.dtype == torch.uint8 else images.float()


def full_cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model state on the CPU: a collective for DTensors (every rank must call it)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu().clone()
            for k, v in model.state_dict().items()}


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
        _check_loss(losses, plan)
    return SingleResult(losses, full_cpu_state(model))


def _shard_model(run: FSDPRun, ctx: DistContext) -> nn.Module:
    """The run's model, ``fully_shard`` on every MLPBlock, then on the root (bottom-up, as FSDP2
    requires): one all-gather and one reduce-scatter per block; a 16-bit ``param_dtype``
    reduces in fp32."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(run.param_dtype, reduce_dtype=torch.float32)
    model = run.plan.shape.build(run.plan.seed)
    blocks = [module for module in model.modules() if isinstance(module, MLPBlock)]
    for module in (*blocks, model):
        fully_shard(module, mesh=mesh, reshard_after_forward=run.reshard_after_forward,
                    mp_policy=policy)
    return model


@dataclass(frozen=True)
class ShardInfo:
    """One parameter as this rank holds it."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: str


def _describe_shards(model: nn.Module) -> list[ShardInfo]:
    """Every parameter of a model that ``fully_shard`` sharded (all of them are DTensors)."""
    return [ShardInfo(name, tuple(p.shape), tuple(p.to_local().shape), str(tuple(p.placements)))
            for name, p in model.named_parameters()]


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank stores: the local shard of a DTensor, padding included."""
    return storage_bytes(t.to_local() if isinstance(t, DTensor) else t for t in tensors)


def padded_parameter_bytes(model: nn.Module, world_size: int) -> int:
    """Bytes of ``model``'s parameters once FSDP2 pads dim 0 to a multiple of ``world_size``,
    so that all-gathers move equal pieces (chapter 8)."""
    check_module("model", model)
    check_positive_int("world_size", world_size)
    total = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        total += math.ceil(rows / world_size) * world_size * (p.numel() // rows) * p.element_size()
    return total


#: A word in the name of a ``c10d`` operator, and the kind of collective it names.
_COLLECTIVE_KINDS = {"allgather": "all_gather", "reduce_scatter": "reduce_scatter",
                     "allreduce": "all_reduce", "broadcast": "broadcast"}


@dataclass
class CommStats:
    """Collective calls and the full, unsharded bytes they carried (chapter 8)."""

    calls: int = 0
    nbytes: int = 0
    dtypes: set[str] = field(default_factory=set)

    def add(self, nbytes: int, dtype: torch.dtype) -> None:
        self.calls += 1
        self.nbytes += nbytes
        self.dtypes.add(str(dtype).removeprefix("torch."))


def _payload(args: tuple[Any, ...]) -> tuple[int, torch.dtype | None]:
    """A collective's largest tensor argument (lists summed): the full, unsharded size."""
    best, dtype = 0, None
    for arg in args:
        tensors = [t for t in tree_flatten(arg)[0] if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes > best:
            best, dtype = nbytes, tensors[0].dtype
    return best, dtype


class CollectiveCounter(TorchDispatchMode):
    """Count the collectives this process issues inside a ``with`` block, by kind: they are
    ``c10d`` operators, so a dispatch mode sees each one, FSDP2's backward hooks included."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, CommStats] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func.namespace == "c10d":
            kinds = [kind for word, kind in _COLLECTIVE_KINDS.items() if word in func.__name__]
            if kinds:
                self.stats.setdefault(kinds[0], CommStats()).add(*_payload(args))
        return func(*args, **(kwargs or {}))


def collective_formula(model: nn.Module, world_size: int, *, reshard_after_forward: bool,
                       param_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Predicted payload bytes of one FSDP2 step, at the padded size: all-gathers before forward
    and (resharded) before backward, in ``param_dtype``; one fp32 reduce-scatter (chapter 8)."""
    padded = padded_parameter_bytes(model, world_size)
    gathers = 2 if reshard_after_forward else 1
    gather_bytes = padded // 2 if param_dtype in (torch.float16, torch.bfloat16) else padded
    return {"all_gather": gathers * gather_bytes, "reduce_scatter": padded}


def counting_allreduce_hook(stats: CommStats, bucket: dist.GradBucket) -> torch.futures.Future:
    """A DDP communication hook that averages a gradient bucket as DDP does and counts it in
    ``stats`` (chapter 8)."""
    buffer = bucket.buffer()
    stats.add(buffer.numel() * buffer.element_size(), buffer.dtype)
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


# DDP checks a hook's annotations against the objects themselves, not strings.
counting_allreduce_hook.__annotations__.update(
    {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})




@dataclass(frozen=True)
class FSDPRun:
    """One run of :func:`train_fsdp`: the plan, how to shard, the dtype the layers compute in
    (None: fp32), and ``hooks`` to resume and save, e.g. ``Checkpoints`` (chapter 8)."""

    plan: TrainPlan
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    hooks: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.plan, TrainPlan):
            raise TypeError(f"plan must be a TrainPlan, got {type(self.plan).__name__}")
        check_bool("reshard_after_forward", self.reshard_after_forward)
        if self.param_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError("param_dtype must be torch.bfloat16, torch.float16 or None (fp32), "
                             f"got {self.param_dtype!r}")

    def run(self, ctx: DistContext) -> FSDPResult:
        return train_fsdp(self, ctx)

    def settings(self) -> dict[str, Any]:
        """What a checkpoint of this run records and a resumed run must repeat, by name."""
        plan = self.plan
        return {"model shape (width, hidden, depth, in, classes)": list(astuple(plan.shape)),
                "global batch size": plan.batch_size, "learning rate": plan.lr,
                "optimizer": plan.optimizer, "seed": plan.seed, "shuffle": plan.shuffle,
                "training examples": len(plan.labels),
                "compute dtype": dtype_name(self.param_dtype)}


@dataclass
class StepWatch:
    """What one rank measured during the last step of a run."""

    held_after_forward: int = 0  # bytes of full parameters kept from forward to backward
    gradient_bytes: int = 0  # of this rank's gradient shards
    compute_dtype: str = "-"  # that the layers compute in
    grad_dtype: str = "-"
    cuda_peak: int | None = None  # the CUDA allocator's peak (None on CPUs)
    comm: dict[str, CommStats] = field(default_factory=dict)


@dataclass
class FSDPResult:
    """What :func:`train_fsdp` returns on rank 0; the per-rank lists cover every rank."""

    losses: list[float]  # mean over the global batch, from step 0
    state_dict: dict[str, torch.Tensor]
    shards: list[ShardInfo]  # rank 0's view
    parameter_bytes: list[int]
    optimizer_bytes: list[int]
    watch: list[StepWatch]  # the last step


def dtype_name(dtype: torch.dtype | None) -> str:
    """"bfloat16" for torch.bfloat16; None (no autocast, no cast) is "float32"."""
    return str(dtype or torch.float32).removeprefix("torch.")


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                scaler: ShardedGradScaler, X: torch.Tensor, y: torch.Tensor,
                watch: StepWatch | None, hooks: Any, step: int) -> torch.Tensor:
    """One optimizer step; a watched step counts its collectives and measures memory into
    ``watch``."""
    if watch is not None and X.is_cuda:
        torch.cuda.reset_peak_memory_stats(X.device)
    with CollectiveCounter() if watch is not None else contextlib.nullcontext() as counter:
        out = model(X)  # in the dtype the layers computed in
        if watch is not None:  # the parameters not resharded after forward are plain tensors
            watch.held_after_forward = storage_bytes(
                p for p in model.parameters() if not isinstance(p, DTensor))
        if hooks:
            hooks.after_forward(step)
        loss = nn.functional.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()  # the loss itself unless fp16 scales it
    if watch is not None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        watch.comm, watch.gradient_bytes = counter.stats, _local_bytes(grads)
        watch.compute_dtype, watch.grad_dtype = dtype_name(out.dtype), dtype_name(grads[0].dtype)
        watch.cuda_peak = torch.cuda.max_memory_allocated(X.device) if X.is_cuda else None
    scaler.step(optimizer)  # fp16: skips a step where a gradient overflowed, on every rank
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _check_loss(losses: list[float], plan: TrainPlan) -> None:
    """The course's divergence rule on the last loss."""
    check_training_loss(losses[-1], when=f"step {len(losses)}", lr=plan.lr,
                        first_loss=losses[0] if len(losses) > 1 else None,
                        advice=f"e.g. {plan.lr / 10:g}; stopped before writing a checkpoint")


def train_fsdp(run: FSDPRun, ctx: DistContext) -> FSDPResult:
    """Train ``run.plan`` with FSDP2 over the ranks of ``ctx``; every rank calls it. The same
    seed builds the same model on every rank; ``fully_shard`` keeps each rank's slice."""
    plan, hooks = run.plan, run.hooks
    model = _shard_model(run, ctx)
    optimizer = make_optimizer(plan.optimizer, model.parameters(), lr=plan.lr)
    # fp16 needs loss scaling (chapter 6); the sharded scaler agrees on overflows over ranks.
    scaler = ShardedGradScaler(ctx.device.type, enabled=run.param_dtype == torch.float16)
    start, losses, settings = 0, [], run.settings()  # the settings, once: a checkpoint's record
    if hooks:
        resumed = hooks.resume(model, optimizer, scaler, settings, plan.steps)
        start, losses = resumed.step, list(resumed.extra.get("losses", []))
    watch = StepWatch()
    for step in range(start, plan.steps):
        X, y = (t.to(ctx.device) for t in plan.local_batch(step, ctx.rank, ctx.world_size))
        watched = watch if step == plan.steps - 1 else None
        total = _train_step(model, optimizer, scaler, X, y, watched, hooks, step).double()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
        # On the mean every rank shares, so all ranks stop together, before a save.
        _check_loss(losses, plan)
        if hooks:
            hooks.after_step(step + 1, model, optimizer, scaler, settings, plan.steps,
                             {"losses": losses, "world_size": ctx.world_size})

    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    per_rank: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(per_rank, (_local_bytes(model.parameters()), _local_bytes(state), watch))
    return FSDPResult(losses, full_cpu_state(model), _describe_shards(model),
                      [r[0] for r in per_rank], [r[1] for r in per_rank], [r[2] for r in per_rank])


def sharding_worker(rank: int, world_size: int, master_port: int,
                    jobs: Sequence[FSDPRun | AccumulationRun],
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """The function :func:`d2lgpu.runtime.distributed.launch` starts on every rank: join the
    group and run each job, so that starting the processes is paid once (chapter 8)."""
    with process_group(rank, world_size, master_port=master_port, timeout_s=timeout_s) as ctx:
        return [job.run(ctx) for job in jobs]


@dataclass
class AccumulationResult:
    """Per variant: the all-reduces counted and the final weights."""

    micro_batches: int
    steps: int
    comm: dict[str, CommStats]
    state_dicts: dict[str, dict[str, torch.Tensor]]


ACCUMULATION_VARIANTS = ("sync every micro-batch", "no_sync until the last")


@dataclass(frozen=True)
class AccumulationRun:
    """DDP training of ``plan``, each rank's share of a batch in ``micro_batches`` pieces, both
    ways, all-reduces counted (chapter 8)."""

    plan: TrainPlan
    micro_batches: int

    def __post_init__(self) -> None:
        if not isinstance(self.plan, TrainPlan):
            raise TypeError(f"plan must be a TrainPlan, got {type(self.plan).__name__}")
        check_positive_int("micro_batches", self.micro_batches)

    def run(self, ctx: DistContext) -> AccumulationResult:
        result = AccumulationResult(self.micro_batches, self.plan.steps, {}, {})
        for variant in ACCUMULATION_VARIANTS:
            stats, state = self._train(variant == "no_sync until the last", ctx)
            result.comm[variant], result.state_dicts[variant] = stats, state
        return result

    def _train(self, use_no_sync: bool, ctx: DistContext) -> tuple[CommStats, dict[str, Any]]:
        plan = self.plan
        model = plan.shape.build(plan.seed).to(ctx.device)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        stats = CommStats()
        ddp.register_comm_hook(stats, counting_allreduce_hook)
        optimizer = make_optimizer(plan.optimizer, ddp.parameters(), lr=plan.lr)
        for step in range(plan.steps):
            X, y = (t.to(ctx.device) for t in plan.local_batch(step, ctx.rank, ctx.world_size))
            parts = list(zip(X.chunk(self.micro_batches), y.chunk(self.micro_batches), strict=True))
            for i, (X_part, y_part) in enumerate(parts):
                # no_sync: backward only adds into .grad; the last backward all-reduces the sum.
                last = i == len(parts) - 1
                with contextlib.nullcontext() if last or not use_no_sync else ddp.no_sync():
                    loss = nn.functional.cross_entropy(ddp(X_part), y_part) * len(X_part) / len(X)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return stats, full_cpu_state(model)
