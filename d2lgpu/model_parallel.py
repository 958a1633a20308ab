"""Model parallelism on CPUs (gloo) and GPUs: pipeline stages, tensor-parallel shards, a 2-D mesh.

Chapter 9's helpers. Each job is a small dataclass with a ``run(ctx)`` method,
so several of them share one :func:`d2lgpu.runtime.distributed.launch` through
:func:`d2lgpu.sharding.sharding_worker`, and each has a one-process reference
(:func:`train_reference`) that it must equal:

* :class:`PipelineRun`: the model's blocks split into one stage per rank
  (``torch.distributed.pipelining``), trained with GPipe or 1F1B on
  microbatches; the activations each stage keeps are counted.
* :class:`BubbleRun`: when each stage of a real pipeline computed, timed inside its
  steps, for a growing number of microbatches: the measured bubble.
* :class:`TensorParallelRun`: every block split over the ranks by
  ``parallelize_module`` (Megatron-style: column-wise then row-wise), an MLP or
  an attention block, with or without sequence parallelism; the collectives
  of one step are counted.
* :class:`TwoDRun`: FSDP2 over one mesh dimension and tensor parallelism over the other;
  :class:`ResumableTwoDRun` adds distributed checkpoints that a run on another mesh
  shape resumes from (the job of :mod:`d2lgpu.model_parallel_train`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from d2lgpu.models import MLPBlock
from d2lgpu.precision import check_precision, precision_policy
from d2lgpu.runtime.checks import (
    check_bool,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_sequence,
    check_training_loss,
)
from d2lgpu.runtime.distributed import DistContext, mark_progress
from d2lgpu.sharding import (
    CheckpointError,
    CollectiveCounter,
    CommStats,
    check_resumable,
    latest_checkpoint,
    load_checkpoint,
    prepare_checkpoint_root,
    read_checkpoint_extra,
    save_checkpoint,
)

__all__ = [
    "SCHEDULES",
    "Attention",
    "BubbleResult",
    "BubbleRun",
    "FIXED_COST_SCHEDULES",
    "FixedCostRun",
    "FixedCostStage",
    "FunctionalCollectiveCounter",
    "MUST_MATCH_2D",
    "ModelSpec",
    "PipelineRun",
    "ResumableTwoDRun",
    "SavedActivations",
    "ScheduleTiming",
    "SplitRow",
    "TensorParallelRun",
    "TrainResult",
    "TwoDRun",
    "bubble_formula",
    "check_2d",
    "check_mesh",
    "check_microbatches",
    "check_stages",
    "fix_torch29_first_exchange",
    "idle_gaps",
    "max_abs_diff",
    "parallelize_2d",
    "param_bytes_2d",
    "plot_pipeline_timeline",
    "schedule_bubble_formula",
    "schedule_unavailable_reason",
    "split_table",
    "split_stages",
    "tp_plan",
    "time_fixed_cost_schedule",
    "train_reference",
]

#: The pipeline schedules of this chapter, by the name the jobs take.
SCHEDULES = ("gpipe", "1f1b")


# ---------------------------------------------------------------------------
# Checks: bad input gets an error that names the fix
# ---------------------------------------------------------------------------


def check_stages(n_layers: int, n_stages: int) -> int:
    """Layers per stage, if ``n_layers`` split evenly into ``n_stages``; else a ValueError
    (chapter 9)."""
    check_positive_int("n_layers", n_layers)
    check_positive_int("n_stages", n_stages)
    if n_stages > n_layers:
        raise ValueError(
            f"{n_stages} pipeline stages for {n_layers} layers: every stage needs at least one "
            f"layer, so use at most {n_layers} ranks or a deeper model"
        )
    if n_layers % n_stages:
        raise ValueError(
            f"{n_layers} layers do not split evenly into {n_stages} stages: use a depth that is "
            f"a multiple of {n_stages}, or a number of ranks that divides {n_layers}"
        )
    return n_layers // n_stages


def _check_spec(spec: object) -> None:
    """A TypeError naming ``spec`` unless it is a ModelSpec."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, e.g. ModelSpec(width=64, depth=4), "
                        f"got {type(spec).__name__} {spec!r}")


def check_microbatches(batch_size: int, n_microbatches: int) -> int:
    """The microbatch size, if ``n_microbatches`` divide ``batch_size``; else a ValueError
    (chapter 9)."""
    check_positive_int("batch_size", batch_size)
    check_positive_int("n_microbatches", n_microbatches)
    if batch_size % n_microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(
            f"a batch of {batch_size} does not split into {n_microbatches} equal microbatches: "
            f"use a number of microbatches that divides it ({divisors}) or a batch size that is "
            f"a multiple of {n_microbatches}"
        )
    return batch_size // n_microbatches


def check_mesh(shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``shape`` as a tuple if its product is ``world_size``; else a ValueError naming the fix
    (chapter 9)."""
    shape = tuple(check_sequence("shape", shape, of="mesh dimensions, e.g. (2, 2)",
                                 allow_empty=True))
    check_positive_int("world_size", world_size)
    if not shape:
        raise ValueError("a device mesh needs at least one dimension, e.g. (world_size,)")
    for size in shape:
        check_positive_int("mesh dimension", size)
    if math.prod(shape) != world_size:
        raise ValueError(
            f"a mesh of shape {shape} has {math.prod(shape)} places but there are {world_size} "
            f"ranks: choose dimensions whose product is {world_size} (e.g. "
            f"(2, {world_size // 2}) for 2-way data parallel)"
            if world_size % 2 == 0
            else f"a mesh of shape {shape} has {math.prod(shape)} places but there are "
            f"{world_size} ranks: choose dimensions whose product is {world_size}"
        )
    return shape


def bubble_formula(n_stages: int, n_microbatches: int) -> float:
    """The idle fraction of a GPipe or 1F1B step, (p - 1) / (m + p - 1), for equal stages
    (chapter 9)."""
    check_positive_int("n_stages", n_stages)
    check_positive_int("n_microbatches", n_microbatches)
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


# ---------------------------------------------------------------------------
# Models: a stack of residual MLP blocks, and an attention block
# ---------------------------------------------------------------------------


class Attention(nn.Module):
    """``x + out(softmax(q k^T / sqrt(d)) v)`` over ``heads`` heads, no mask, no norm.

    The heads are found from the local width (``view(..., -1, head_dim)``), so
    the same code runs on a tensor-parallel shard that holds some of the heads.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        check_positive_int("width", width)
        check_positive_int("heads", heads)
        if width % heads:
            raise ValueError(f"width {width} does not split into {heads} heads: use a multiple")
        self.head_dim = width // heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        B, S, _ = X.shape
        q, k, v = (
            lin(X).view(B, S, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v)
        return X + self.out(a.transpose(1, 2).reshape(B, S, -1))


@dataclass(frozen=True)
class ModelSpec:
    """A stack of ``depth`` blocks of width ``width``: MLP blocks, or attention blocks
    (chapter 9)."""

    width: int = 64
    hidden: int = 256
    depth: int = 4
    kind: str = "mlp"
    heads: int = 4
    #: A LayerNorm before the blocks (sequence parallelism's example of a non-matmul layer).
    norm: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("mlp", "attention"):
            raise ValueError(f"kind must be 'mlp' or 'attention', got {self.kind!r}")
        for name in ("width", "hidden", "depth", "heads"):
            check_positive_int(name, getattr(self, name))
        check_bool("norm", self.norm)
        if self.kind == "attention" and self.width % self.heads:
            raise ValueError(f"width {self.width} does not split into {self.heads} heads: use "
                             f"a width that is a multiple of {self.heads}")

    def build(self, seed: int = 0) -> nn.Sequential:
        torch.manual_seed(seed)
        if self.kind == "mlp":
            blocks = [MLPBlock(self.width, self.hidden) for _ in range(self.depth)]
        else:
            blocks = [Attention(self.width, self.heads) for _ in range(self.depth)]
        return nn.Sequential(*([nn.LayerNorm(self.width)] if self.norm else []), *blocks)

    def data(self, batch_size: int, seq_len: int, step: int, seed: int = 0):
        """Inputs ``[B, S, width]`` and targets of one step, the same on every rank."""
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        X = torch.randn(batch_size, seq_len, self.width, generator=gen)
        return X, torch.randn(batch_size, seq_len, self.width, generator=gen)


def split_stages(model: nn.Sequential, n_stages: int) -> list[nn.Sequential]:
    """Equal runs of consecutive layers: ``n_stages`` stages of one pipeline."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model must be an nn.Sequential (its layers are split in order), "
                        f"got {type(model).__name__}")
    per = check_stages(len(model), n_stages)
    return [model[i * per : (i + 1) * per] for i in range(n_stages)]


@dataclass
class TrainResult:
    """The weights after training (full, unsharded, on rank 0) and the loss of every step."""

    state_dict: dict[str, torch.Tensor]
    losses: list[float]
    extra: dict[str, Any] = field(default_factory=dict)


def _optimizer(params, lr: float) -> torch.optim.Optimizer:
    # SGD with momentum: unlike Adam, it passes a wrong gradient scale on to the weights.
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def train_reference(
    spec: ModelSpec, batch_size: int, seq_len: int, steps: int, lr: float, seed: int = 0
) -> TrainResult:
    """One process, the whole model, the whole batch: what every parallel run must equal
    (chapter 9)."""
    _check_spec(spec)
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("steps", steps)):
        check_positive_int(name, value)
    check_positive_float("lr", lr)
    check_seed(seed)
    model = spec.build(seed)
    opt = _optimizer(model.parameters(), lr)
    losses = []
    for step in range(steps):
        X, Y = spec.data(batch_size, seq_len, step, seed)
        loss = F.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return TrainResult({k: v.detach().clone() for k, v in model.state_dict().items()}, losses)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two state dicts with the same keys (chapter 9)."""
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a state dict (model.state_dict() or "
                            f"TrainResult.weights), got {type(value).__name__}")
    if a.keys() != b.keys():
        raise ValueError(f"different keys: {sorted(set(a) ^ set(b))}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------------------
# Counting: saved activations and functional collectives
# ---------------------------------------------------------------------------


class SavedActivations:
    """Bytes of tensors that autograd keeps for backward, now and at the peak, in a ``with`` block.

    A saved-tensor hook counts each tensor when forward saves it, and a small
    holder object counts it off when autograd drops it (after its backward).
    Parameters are not activations and are not counted.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._params: set[int] = set()

    def ignore(self, params) -> SavedActivations:
        self._params = {p.data_ptr() for p in params}
        return self

    def _pack(self, t: torch.Tensor):
        if t.data_ptr() in self._params:
            return t
        nbytes = t.numel() * t.element_size()
        return _Held(self, t, nbytes)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    @contextmanager
    def __call__(self) -> Iterator[SavedActivations]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


class _Held:
    def __init__(self, counter: SavedActivations, tensor: torch.Tensor, nbytes: int) -> None:
        self.counter, self.tensor, self.nbytes = counter, tensor, nbytes
        counter.live += nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self) -> None:
        self.counter.live -= self.nbytes


class FunctionalCollectiveCounter(CollectiveCounter):
    """:class:`d2lgpu.sharding.CollectiveCounter`, also counting DTensor's collectives.

    DTensor issues the functional collectives (``_c10d_functional.all_reduce``,
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``) rather than the
    ``c10d`` ones that FSDP2 uses; sizes are full (unsharded) payloads.
    """

    _KINDS = {
        "all_reduce": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_to_all_single": "all_to_all",
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func.namespace == "_c10d_functional":
            kind = self._KINDS.get(func.__name__.split(".")[0])
            if kind is not None:
                t = args[0]
                nbytes = t.numel() * t.element_size()
                if kind == "all_gather":  # the output is group_size times the input
                    nbytes *= args[1]
                self.stats.setdefault(kind, CommStats()).add(nbytes, t.dtype)
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


# ---------------------------------------------------------------------------
# Pipeline parallel
# ---------------------------------------------------------------------------


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    return ScheduleGPipe if name == "gpipe" else Schedule1F1B


@dataclass(frozen=True)
class PipelineRun:
    """Train ``spec`` for ``steps`` steps as a pipeline of one stage per rank (chapter 9)."""

    spec: ModelSpec = ModelSpec()
    batch_size: int = 16
    seq_len: int = 8
    n_microbatches: int = 4
    schedule: str = "1f1b"
    steps: int = 2
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        _check_spec(self.spec)
        check_microbatches(self.batch_size, self.n_microbatches)
        _schedule_class(self.schedule)
        check_positive_int("seq_len", self.seq_len)
        check_positive_int("steps", self.steps)
        check_positive_float("lr", self.lr)
        check_seed(self.seed)

    def run(self, ctx: DistContext) -> TrainResult:
        return train_pipeline(self, ctx)


def _build_schedule(stage_module: nn.Module, run, ctx: DistContext, n_microbatches: int):
    from torch.distributed.pipelining import PipelineStage

    # torch 2.9 refuses fewer microbatches than stages in every single-stage schedule (the
    # check sits in PipelineScheduleSingle); later versions only in Schedule1F1B. Refuse it
    # here on every version, with the fix named.
    if n_microbatches < ctx.world_size:
        raise ValueError(
            f"a pipeline of {ctx.world_size} stages needs at least {ctx.world_size} "
            f"microbatches, got {n_microbatches}: use more microbatches (or fewer stages)"
        )
    stage = fix_torch29_first_exchange(
        PipelineStage(stage_module, ctx.rank, ctx.world_size, ctx.device)
    )
    return _schedule_class(run.schedule)(stage, n_microbatches, loss_fn=F.mse_loss)


def fix_torch29_first_exchange(stage: Any) -> Any:
    """Make ``stage``'s first exchange with its neighbours work on gloo under torch 2.9.

    torch 2.9's schedules start by sending each neighbour ``torch.tensor(stage_index)``
    (int64, 8 bytes) into a ``torch.zeros(1)`` (float32, 4 bytes): NCCL does not check the
    size, gloo stops the process ("8 vs 4. Received data size doesn't match"). torch 2.13
    sends a float32 there (converting it again changes nothing), and torch 2.15 has no such
    exchange: then this does nothing.
    """
    from torch.distributed.pipelining import PipelineStage

    if not isinstance(stage, PipelineStage):
        raise TypeError(f"stage must be a torch.distributed.pipelining.PipelineStage, got "
                        f"{type(stage).__name__} {stage!r:.60}")
    make_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if make_ops is None:
        return stage

    def float_ops() -> list[Any]:
        ops = make_ops()
        for op in ops:
            op.tensor = op.tensor.float()
        return ops

    stage._get_init_p2p_neighbors_ops = float_ops
    return stage


def _pipeline_step(schedule, X, Y, ctx: DistContext) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1
    if first and last:
        schedule.step(X, target=Y, losses=losses)
    elif first:
        schedule.step(X)
    elif last:
        schedule.step(target=Y, losses=losses)
    else:
        schedule.step()
    return losses


def _gather_state(module: nn.Module, ctx: DistContext) -> dict:
    # A slice of an nn.Sequential keeps the layers' names ("2.fc1.weight"): the whole
    # model's state dict is the union of the stages'.
    local = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    parts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def train_pipeline(run: PipelineRun, ctx: DistContext) -> TrainResult:
    """Each rank trains its stage; rank 0 returns all weights, the losses and each stage's peak
    of saved activations (``extra["activation_peak"]``, one number per stage)."""
    model = run.spec.build(run.seed)
    stage_module = split_stages(model, ctx.world_size)[ctx.rank].to(ctx.device)
    schedule = _build_schedule(stage_module, run, ctx, run.n_microbatches)
    opt = _optimizer(stage_module.parameters(), run.lr)
    counter = SavedActivations().ignore(stage_module.parameters())
    losses = []
    for step in range(run.steps):
        X, Y = (
            t.to(ctx.device) for t in run.spec.data(run.batch_size, run.seq_len, step, run.seed)
        )
        with counter():
            mb_losses = _pipeline_step(schedule, X, Y, ctx)
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(mb_losses).mean().item() if mb_losses else float("nan"))
    state = _gather_state(stage_module, ctx)
    peaks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(peaks, counter.peak)
    all_losses: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(all_losses, losses)
    return TrainResult(state, all_losses[-1], {"activation_peak": peaks})


@dataclass(frozen=True)
class BubbleResult:
    """Per number of microbatches, one timed pipeline step of real stages.

    ``events[i]`` is the timeline of the step of ``n_microbatches[i]``: one
    ``(rank, kind, microbatch, start, end)`` per piece of work, ``kind`` "F" (the stage's
    forward) or "B" (its backward, from the arrival of the output's gradient to the last
    weight gradient), in seconds from the step's start. Every piece is timed inside the
    step it belongs to, so the pieces of one rank never overlap and never leave the step:
    the idle time, what is left of the step, cannot be negative.
    """

    n_microbatches: list[int]
    step_seconds: list[float]
    busy_seconds: list[list[float]]  # [m index][rank]
    events: list[list[tuple[int, str, int, float, float]]]

    @property
    def idle_fraction(self) -> list[float]:
        """1 - busy / step time, averaged over the ranks."""
        return [
            1 - statistics.fmean(busy) / step
            for busy, step in zip(self.busy_seconds, self.step_seconds, strict=True)
        ]

    def piece_seconds(self, index: int, kind: str) -> list[list[float]]:
        """``[rank][microbatch]``: how long each ``kind`` ("F" or "B") piece of step
        ``index`` took."""
        if kind not in ("F", "B"):
            raise ValueError(f"kind must be 'F' or 'B', got {kind!r}")
        m, events = self.n_microbatches[index], self.events[index]
        n_ranks = len(self.busy_seconds[index])
        out = [[0.0] * m for _ in range(n_ranks)]
        for rank, k, mb, start, end in events:
            if k == kind:
                out[rank][mb] = end - start
        return out


@dataclass(frozen=True)
class BubbleRun:
    """Time pipeline steps of real stages (the model's blocks) for each number of
    microbatches of a fixed size (chapter 9).

    Each stage records, inside every step, when its forward and its backward of each
    microbatch began and ended: what is left of the step is idle, the bubble plus the
    messages. ``repeats`` steps per ``m``; the one of median length is kept.
    """

    spec: ModelSpec = ModelSpec(width=256, hidden=1024, depth=4)
    microbatch_size: int = 8
    seq_len: int = 16
    n_microbatches: tuple[int, ...] = (2, 4, 8, 16)
    schedule: str = "gpipe"
    repeats: int = 5

    def __post_init__(self) -> None:
        _check_spec(self.spec)
        _schedule_class(self.schedule)
        for m in check_sequence("n_microbatches", self.n_microbatches, of="positive ints"):
            check_positive_int("n_microbatches", m)
        for name in ("microbatch_size", "seq_len", "repeats"):
            check_positive_int(name, getattr(self, name))

    def run(self, ctx: DistContext) -> BubbleResult:
        return measure_bubble(self, ctx)


def _synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued on it (a no-op on the CPU).

    A host clock around GPU work measures only the launches unless the device is
    synchronized first; with NCCL, ``work.wait()`` only orders streams and does not
    wait either.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _BackwardStarts(torch.autograd.Function):
    """Identity; its backward runs first in the stage's backward and records when."""

    @staticmethod
    def forward(ctx, x, record):  # type: ignore[override]
        ctx.record = record
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _wait_for(grad)
        ctx.record()
        return grad, None


class _TimedStage(nn.Module):
    """``module`` as a pipeline stage that records when each forward and backward ran.

    A backward begins when the gradient of the stage's output arrives (the identity
    function on the output) and ends with the last weight gradient accumulated (a hook
    on every parameter); the first stage has no input gradient to compute, so the weights'
    are its last work."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.module, self.device = module, device
        self.forwards: list[tuple[float, float]] = []
        self.backward_starts: list[float] = []
        self.accumulated: list[float] = []
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._accumulated)

    def _now(self) -> float:
        _synchronize(self.device)
        return time.perf_counter()

    def _accumulated(self, _param: torch.Tensor) -> None:
        self.accumulated.append(self._now())

    def _backward_starts(self) -> None:
        self.backward_starts.append(self._now())

    def clear(self) -> None:
        self.forwards.clear()
        self.backward_starts.clear()
        self.accumulated.clear()

    def pieces(self) -> list[tuple[str, int, float, float]]:
        """``(kind, microbatch, start, end)`` of this step's pieces, in the order they ran
        (GPipe and 1F1B run each kind's microbatches in order)."""
        out = [("F", i, a, b) for i, (a, b) in enumerate(self.forwards)]
        starts = self.backward_starts + [math.inf]
        for i, start in enumerate(starts[:-1]):
            ends = [t for t in self.accumulated if start <= t < starts[i + 1]]
            out.append(("B", i, start, max(ends, default=start)))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self._now()
        out = self.module(x)
        self.forwards.append((start, self._now()))
        return _BackwardStarts.apply(out, self._backward_starts)


def measure_bubble(run: BubbleRun, ctx: DistContext) -> BubbleResult:
    """Every rank calls it; rank 0 returns the steps' times and their timelines."""
    model = run.spec.build(0)
    stage = _TimedStage(split_stages(model, ctx.world_size)[ctx.rank].to(ctx.device),
                        ctx.device)
    steps, busy, timelines = [], [], []
    for m in run.n_microbatches:
        schedule = _build_schedule(stage, run, ctx, m)
        X, Y = (t.to(ctx.device)
                for t in run.spec.data(m * run.microbatch_size, run.seq_len, 0))
        _pipeline_step(schedule, X, Y, ctx)  # warm-up: the first step also sets up buffers
        records = []
        for _ in range(run.repeats):
            stage.clear()
            stage.zero_grad()
            _synchronize(ctx.device)
            dist.barrier()
            start = time.perf_counter()
            _pipeline_step(schedule, X, Y, ctx)
            _synchronize(ctx.device)
            end = time.perf_counter()
            gathered: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(gathered, (start, end, stage.pieces()))
            t0 = min(g[0] for g in gathered)
            records.append((max(g[1] for g in gathered) - t0, t0, gathered))
        stage.zero_grad()
        step_s, t0, gathered = sorted(records, key=lambda r: r[0])[len(records) // 2]
        steps.append(step_s)
        busy.append([sum(b - a for _, _, a, b in pieces) for _, _, pieces in gathered])
        timelines.append([(rank, kind, mb, a - t0, b - t0)
                          for rank, (_, _, pieces) in enumerate(gathered)
                          for kind, mb, a, b in pieces])
    return BubbleResult(list(run.n_microbatches), steps, busy, timelines)


# ---------------------------------------------------------------------------
# The bubble as a property of the schedule: stages of known, fixed cost
# ---------------------------------------------------------------------------

#: Schedules the fixed-cost pipeline runs: name -> (class in torch.distributed.pipelining,
#: stages per rank). The interleaved and zero-bubble ones hold two stages on every rank.
FIXED_COST_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "interleaved-zero-bubble": ("ScheduleInterleavedZeroBubble", 2),
}


def schedule_unavailable_reason(name: str) -> str | None:
    """Why schedule ``name`` cannot run with this torch, or None when it can."""
    if name not in FIXED_COST_SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(FIXED_COST_SCHEDULES)}, got {name!r}")
    import torch.distributed.pipelining as pipelining

    cls = FIXED_COST_SCHEDULES[name][0]
    if not hasattr(pipelining, cls):
        return f"torch {torch.__version__} has no torch.distributed.pipelining.{cls}"
    return None


def schedule_bubble_formula(name: str, n_ranks: int, n_microbatches: int) -> float:
    """The idle fraction of a step when every stage costs the same.

    GPipe and 1F1B: (p - 1) / (m + p - 1). Interleaved 1F1B with v stages per rank, each
    1/v of the work: the warm-up and cool-down shrink to (p - 1) stage-times of 1/v,
    so (p - 1) / (v m + p - 1). Interleaved zero-bubble, with forward (F), input gradient
    (I) and weight gradient (W) of equal cost: the weight gradients, which nothing waits
    for, fill the gaps, and the idle time is (p - 1)(F + I - W) instead of
    (p - 1)(F + I + W) (Qi et al., 2024), a third: (p - 1) / (3 v m + p - 1).
    """
    check_positive_int("n_ranks", n_ranks)
    check_positive_int("n_microbatches", n_microbatches)
    if name not in FIXED_COST_SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(FIXED_COST_SCHEDULES)}, got {name!r}")
    p, m = n_ranks, n_microbatches
    v = FIXED_COST_SCHEDULES[name][1]
    if name == "interleaved-zero-bubble":
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def _wait_for(tensor: torch.Tensor) -> None:
    """Make the host wait until ``tensor`` is ready on its device.

    Under NCCL a pipeline stage receives its input (or its output's gradient) with an
    ``irecv`` whose ``Work.wait()`` makes the *stream* wait, not the host. A stage whose
    cost is host time (a sleep) would then start it before the input has arrived, and the
    bubble would read about 0. Syncing the current stream ties the cost to the input's
    arrival, as a GPU kernel's would be. On a CPU (gloo) the input is there already.
    """
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


class _Cost(torch.autograd.Function):
    """Identity forward; a backward that waits for its gradient, then sleeps ``seconds``
    and records when it ran."""

    @staticmethod
    def forward(ctx, x, seconds, record, kind):  # type: ignore[override]
        ctx.seconds, ctx.record, ctx.kind = seconds, record, kind
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        _wait_for(grad)
        start = time.perf_counter()
        time.sleep(ctx.seconds)
        ctx.record(ctx.kind, start, time.perf_counter())
        return grad.contiguous(), None, None, None


class FixedCostStage(nn.Module):
    """A pipeline stage whose work takes a known time: forward ``forward_s``; in backward,
    ``input_s`` for the gradient of its input (I) and ``weight_s`` for its weight's (W) (chapter 9).

    It sleeps instead of computing, so its cost does not depend on the machine or on what
    else runs there, and it records every piece of work in ``events`` as
    ``(stage_index, kind, start, end)`` on ``time.perf_counter()``'s clock, which all
    processes of one machine share. The output equals the input (the weights start at 0).
    """

    def __init__(self, stage_index: int, forward_s: float, input_s: float, weight_s: float):
        super().__init__()
        check_positive_int("stage_index", stage_index + 1)
        for name, value in (("forward_s", forward_s), ("input_s", input_s),
                            ("weight_s", weight_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        self.stage_index = stage_index
        self.costs = {"F": float(forward_s), "I": float(input_s), "W": float(weight_s)}
        self.events: list[tuple[int, str, float, float]] = []
        # The anchor puts the I work on a path that needs a gradient even in the first
        # stage, whose input (the batch) needs none.
        self.anchor = nn.Parameter(torch.zeros(1))
        self.weight = nn.Parameter(torch.zeros(1))

    def _record(self, kind: str, start: float, end: float) -> None:
        self.events.append((self.stage_index, kind, start, end))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _wait_for(x)  # the received input has arrived before the stage's cost starts
        start = time.perf_counter()
        time.sleep(self.costs["F"])
        self._record("F", start, time.perf_counter())
        h = _Cost.apply(x + self.anchor, self.costs["I"], self._record, "I")
        w = _Cost.apply(self.weight, self.costs["W"], self._record, "W")
        return h + h.detach() * w  # W's node lies only on the weight's path


def idle_gaps(spans: Sequence[tuple[float, float]], end: float, min_gap: float) -> float:
    """The total length of the gaps of at least ``min_gap`` between ``spans`` (``(start,
    end)`` pairs of one worker's busy time, in seconds from the start) and ``end``."""
    check_sequence("spans", spans, of="(start, end) pairs", allow_empty=True)
    t, total = 0.0, 0.0
    for a, b in sorted(spans) + [(end, end)]:
        if a - t >= min_gap:
            total += a - t
        t = max(t, b)
    return total


@dataclass(frozen=True)
class ScheduleTiming:
    """Fixed-cost pipeline steps of one schedule, per number of microbatches.

    ``events[i]`` is the timeline of the step of ``n_microbatches[i]``: one
    ``(rank, stage, kind, microbatch, start, end)`` per piece of work, in seconds from
    the start of the step; ``busy_seconds[i][rank]`` sums them per rank.
    """

    schedule: str
    n_ranks: int
    unit_s: float
    n_microbatches: list[int]
    step_seconds: list[float]
    busy_seconds: list[list[float]]
    events: list[list[tuple[int, int, str, int, float, float]]]

    @property
    def idle_fraction(self) -> list[float]:
        """1 - busy / step time, averaged over the ranks: all the time a rank did not work."""
        return [1 - statistics.fmean(busy) / step
                for busy, step in zip(self.busy_seconds, self.step_seconds, strict=True)]

    @property
    def bubble_fraction(self) -> list[float]:
        """The idle time in gaps of at least half a piece of work (what the schedule leaves
        while a rank waits for its neighbour's forward or backward), as a fraction of the
        step, averaged over the ranks. The shorter gaps are the cost of each message:
        sending it and waking the process that waits for it."""
        v = FIXED_COST_SCHEDULES[self.schedule][1]
        min_gap = self.unit_s / v / 2
        out = []
        for events, step in zip(self.events, self.step_seconds, strict=True):
            fractions = []
            for rank in range(self.n_ranks):
                spans = sorted((a, b) for r, _, _, _, a, b in events if r == rank)
                fractions.append(idle_gaps(spans, step, min_gap) / step)
            out.append(statistics.fmean(fractions))
        return out

    @property
    def formula(self) -> list[float]:
        return [schedule_bubble_formula(self.schedule, self.n_ranks, m)
                for m in self.n_microbatches]


@dataclass(frozen=True)
class FixedCostRun:
    """Time pipeline steps of :class:`FixedCostStage` stages under ``schedule`` (chapter 9).

    Every rank does ``unit_s`` of forward, ``unit_s`` of I and ``unit_s`` of W per
    microbatch (split over its stages when it holds several). Each ``m`` runs once to set
    the stages up (at no cost), then ``repeats`` times; the fastest step is kept, since
    what else runs on the machine can only add time.
    """

    schedule: str = "gpipe"
    n_microbatches: tuple[int, ...] = (2, 4, 8)
    unit_s: float = 0.04
    repeats: int = 2

    def __post_init__(self) -> None:
        if self.schedule not in FIXED_COST_SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(FIXED_COST_SCHEDULES)}, "
                             f"got {self.schedule!r}")
        for m in check_sequence("n_microbatches", self.n_microbatches, of="positive ints"):
            check_positive_int("n_microbatches", m)
        check_positive_float("unit_s", self.unit_s)
        check_positive_int("repeats", self.repeats)

    def run(self, ctx: DistContext) -> ScheduleTiming:
        return time_fixed_cost_schedule(self, ctx)


def _fixed_cost_stages(run: FixedCostRun, ctx: DistContext) -> list[FixedCostStage]:
    v = FIXED_COST_SCHEDULES[run.schedule][1]
    indices = [ctx.rank + k * ctx.world_size for k in range(v)]  # rank r: stages r, r + p, ...
    return [FixedCostStage(i, 0.0, 0.0, 0.0).to(ctx.device) for i in indices]


def time_fixed_cost_schedule(run: FixedCostRun, ctx: DistContext) -> ScheduleTiming:
    """Every rank calls it; rank 0 returns the steps' times and their timelines."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    reason = schedule_unavailable_reason(run.schedule)
    if reason is not None:
        raise RuntimeError(reason)
    cls_name, v = FIXED_COST_SCHEDULES[run.schedule]
    modules = _fixed_cost_stages(run, ctx)
    n_stages = ctx.world_size * v
    indices = [mod.stage_index for mod in modules]
    has_first, has_last = 0 in indices, n_stages - 1 in indices
    steps, busy, timelines = [], [], []
    for m in run.n_microbatches:
        stages = [fix_torch29_first_exchange(PipelineStage(mod, mod.stage_index, n_stages,
                                                           ctx.device)) for mod in modules]
        schedule_cls = getattr(pipelining, cls_name)
        schedule = schedule_cls(stages[0] if v == 1 else stages, m, loss_fn=F.mse_loss)
        X = torch.ones(2 * m, 16, device=ctx.device)

        def step(schedule=schedule, X=X) -> None:
            args = (X,) if has_first else ()
            kwargs = {"target": torch.zeros_like(X)} if has_last else {}
            schedule.step(*args, **kwargs)

        for mod in modules:  # set the stages up (shapes, buffers) at no cost
            mod.costs = {"F": 0.0, "I": 0.0, "W": 0.0}
        step()
        for mod in modules:
            mod.costs = {k: run.unit_s / v for k in ("F", "I", "W")}
        best = None
        for _ in range(run.repeats):
            for mod in modules:
                mod.events.clear()
                mod.zero_grad()
            _synchronize(ctx.device)
            dist.barrier()
            start = time.perf_counter()
            step()
            _synchronize(ctx.device)
            end = time.perf_counter()
            events = sorted(e for mod in modules for e in mod.events)
            gathered: list[Any] = [None] * ctx.world_size
            dist.all_gather_object(gathered, (start, end, events))
            t0 = min(g[0] for g in gathered)
            t1 = max(g[1] for g in gathered)
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, t0, gathered)
        step_s, t0, gathered = best
        timeline, per_rank = [], []
        for rank, (_, _, events) in enumerate(gathered):
            seen: dict[tuple[int, str], int] = {}
            for stage, kind, a, b in sorted(events, key=lambda e: e[2]):
                mb = seen.get((stage, kind), 0)  # each stage works on microbatches in order
                seen[(stage, kind)] = mb + 1
                timeline.append((rank, stage, kind, mb, a - t0, b - t0))
            per_rank.append(sum(b - a for _, _, a, b in events))
        steps.append(step_s)
        busy.append(per_rank)
        timelines.append(timeline)
    return ScheduleTiming(run.schedule, ctx.world_size, run.unit_s, list(run.n_microbatches),
                          steps, busy, timelines)


_KIND_COLORS = {"F": "tab:blue", "I": "tab:orange", "W": "tab:green"}


def plot_pipeline_timeline(timing: ScheduleTiming, index: int = 0, ax=None, title=None):
    """A Gantt chart of step ``index`` of ``timing``: one row per rank, one bar per piece of
    work (F forward, I input gradient, W weight gradient, labelled with the microbatch);
    the white gaps are the idle time (chapter 9)."""
    if not isinstance(timing, ScheduleTiming):
        raise TypeError(f"timing must be a ScheduleTiming, got {type(timing).__name__}")
    if not isinstance(index, int) or not 0 <= index < len(timing.n_microbatches):
        raise ValueError(f"index must pick one of {len(timing.n_microbatches)} steps, "
                         f"got {index!r}")
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(8.0, 1.0 + 0.5 * timing.n_ranks))
    unit = timing.unit_s
    for rank, _stage, kind, mb, a, b in timing.events[index]:
        ax.broken_barh([(a / unit, (b - a) / unit)], (rank - 0.4, 0.8),
                       facecolors=_KIND_COLORS[kind], edgecolor="white", linewidth=0.5)
        if (b - a) / unit > 0.3:
            ax.text((a + b) / 2 / unit, rank, f"{mb}", ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(timing.n_ranks), [f"rank {r}" for r in range(timing.n_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, timing.step_seconds[index] / unit)
    ax.set_xlabel(f"time (units of {unit * 1e3:.0f} ms: one forward of one microbatch)")
    m = timing.n_microbatches[index]
    ax.set_title(title or f"{timing.schedule}, {timing.n_ranks} ranks, m = {m}: bubble "
                 f"{timing.bubble_fraction[index]:.0%} (formula "
                 f"{timing.formula[index]:.0%}), all idle {timing.idle_fraction[index]:.0%}",
                 fontsize=9)
    from matplotlib.patches import Patch

    names = {"F": "forward", "I": "input gradient", "W": "weight gradient"}
    ax.legend(handles=[Patch(color=c, label=names[k]) for k, c in _KIND_COLORS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    return ax


# ---------------------------------------------------------------------------
# Tensor parallel, and 2-D (FSDP2 x tensor parallel)
# ---------------------------------------------------------------------------


def tp_plan(spec: ModelSpec, sequence_parallel: bool = False) -> dict[str, Any]:
    """``parallelize_module``'s plan for every block of ``spec.build()``.

    Megatron-style: the first matmuls column-wise (each rank computes some of the
    hidden units or heads), the last one row-wise (each rank's partial sum, then
    one all-reduce). With ``sequence_parallel`` the activations between blocks stay
    split along the sequence: the all-reduce becomes a reduce-scatter, and an
    all-gather brings the whole sequence back before the next block's matmuls.
    """
    _check_spec(spec)
    check_bool("sequence_parallel", sequence_parallel)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    offset = 1 if spec.norm else 0
    first = ("fc1",) if spec.kind == "mlp" else ("q", "k", "v")
    last = "fc2" if spec.kind == "mlp" else "out"
    plan: dict[str, Any] = {}
    if spec.norm and sequence_parallel:
        plan["0"] = SequenceParallel(use_local_output=True)
    for i in range(offset, offset + spec.depth):
        for name in first:
            plan[f"{i}.{name}"] = (
                ColwiseParallel(input_layouts=Shard(1)) if sequence_parallel else ColwiseParallel()
            )
        plan[f"{i}.{last}"] = (
            RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        )
    return plan


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
    return out


@dataclass(frozen=True)
class TensorParallelRun:
    """Train ``spec`` with every block split over the ranks (tensor parallel); count one step's
    collectives (``extra["comm"]``: kind -> (calls, bytes)) (chapter 9)."""

    spec: ModelSpec = ModelSpec()
    batch_size: int = 4
    seq_len: int = 8
    steps: int = 2
    lr: float = 0.05
    seed: int = 0
    sequence_parallel: bool = False

    def run(self, ctx: DistContext) -> TrainResult:
        return train_tensor_parallel(self, ctx)


def _check_tp(spec: ModelSpec, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    split = spec.hidden if spec.kind == "mlp" else spec.heads
    what = "hidden units" if spec.kind == "mlp" else "heads"
    if split % tp:
        raise ValueError(
            f"{split} {what} do not split over {tp} tensor-parallel ranks: use a multiple of {tp}"
        )
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"a sequence of {seq_len} does not split over {tp} ranks: use a multiple")


def train_tensor_parallel(run: TensorParallelRun, ctx: DistContext) -> TrainResult:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    _check_tp(run.spec, ctx.world_size, run.seq_len, run.sequence_parallel)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    model = run.spec.build(run.seed).to(ctx.device)
    parallelize_module(model, mesh, tp_plan(run.spec, run.sequence_parallel))
    opt = _optimizer(model.parameters(), run.lr)
    losses, comm = [], {}
    chunk = run.seq_len // ctx.world_size
    for step in range(run.steps):
        X, Y = (
            t.to(ctx.device) for t in run.spec.data(run.batch_size, run.seq_len, step, run.seed)
        )
        if run.sequence_parallel:  # each rank holds its part of the sequence
            X = X[:, ctx.rank * chunk : (ctx.rank + 1) * chunk]
            Y = Y[:, ctx.rank * chunk : (ctx.rank + 1) * chunk]
        with FunctionalCollectiveCounter() as counter:
            loss = F.mse_loss(model(X), Y)
            if run.sequence_parallel:
                # Each rank's loss is the mean over its part of the sequence; the mean over
                # the whole sequence is their average, and the collectives sum the gradients.
                loss = loss / ctx.world_size
            loss.backward()
        if step == 0:
            comm = {k: (s.calls, s.nbytes) for k, s in counter.stats.items()}
        opt.step()
        opt.zero_grad()
        if run.sequence_parallel:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        losses.append(loss.item())
    return TrainResult(_full_state(model), losses, {"comm": comm})


@dataclass(frozen=True)
class TwoDRun:
    """FSDP2 over mesh dimension ``dp`` and tensor parallel over ``tp``: ``mesh_shape = (dp, tp)``
    (chapter 9).

    The batch is split over ``dp``; the ranks of one ``tp`` group see the same examples.
    ``precision`` is a word of :data:`d2lgpu.precision.PRECISIONS`: bf16 or fp16 become
    FSDP2's ``MixedPrecisionPolicy`` (compute in it, reduce gradients in fp32).
    ``extra["bytes_per_rank"]``: each rank's bytes of parameters, and of optimizer state.
    """

    spec: ModelSpec = ModelSpec()
    mesh_shape: tuple[int, int] = (2, 2)
    batch_size: int = 8
    seq_len: int = 8
    steps: int = 2
    lr: float = 0.05
    seed: int = 0
    precision: str = "fp32"

    def __post_init__(self) -> None:
        _check_spec(self.spec)
        check_precision(self.precision)

    def run(self, ctx: DistContext) -> TrainResult:
        return train_2d(self, ctx)


@dataclass(frozen=True)
class ResumableTwoDRun:
    """A :class:`TwoDRun` that writes distributed checkpoints and resumes from them.

    Every ``save_every`` steps, and after the last one, all ranks write the model, the
    optimizer and the step to ``checkpoint_root/step-NNNNNN``
    (:func:`d2lgpu.sharding.save_checkpoint`: complete or absent). A run starts from the
    latest complete checkpoint there, whatever the mesh shape that wrote it: DCP reads, for
    each rank, the pieces of the saved tensors that it now holds. The settings that decide
    the weights (:data:`MUST_MATCH_2D`) must be those of the checkpoint.
    """

    two_d: TwoDRun
    checkpoint_root: str
    save_every: int
    #: Rank 0 prints the loss at every checkpoint, what it resumed from and the mesh change.
    log: bool = False
    #: For showing a crash: rank ``kill_rank`` is killed (SIGKILL, as the out-of-memory
    #: killer does) after the forward of step ``kill_at_step`` (counted from 0), while the
    #: others wait for it.
    kill_rank: int | None = None
    kill_at_step: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.two_d, TwoDRun):
            raise TypeError(f"two_d must be a TwoDRun, got {type(self.two_d).__name__}")
        if not isinstance(self.checkpoint_root, (str, os.PathLike)) or not str(
            self.checkpoint_root
        ):
            raise TypeError(f"checkpoint_root must be a directory path, "
                            f"got {self.checkpoint_root!r}")
        check_positive_int("save_every", self.save_every)
        check_bool("log", self.log)

    def run(self, ctx: DistContext) -> TrainResult:
        return train_2d(self.two_d, ctx, self)


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def parallelize_2d(
    model: nn.Module, spec: ModelSpec, mesh, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """Tensor parallel over ``mesh["tp"]``, then ``fully_shard`` each block and the root over
    ``mesh["dp"]``: the order FSDP2 needs (it shards the DTensors TP made). With
    ``param_dtype`` (bf16 or fp16) the blocks compute in it and reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], tp_plan(spec))
    kwargs: dict[str, Any] = {"mesh": mesh["dp"]}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32
        )
    for block in model:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def check_2d(
    spec: ModelSpec, mesh_shape: Sequence[int], world_size: int, batch_size: int
) -> tuple[int, int]:
    """``(dp, tp)`` if ``spec`` trains on that mesh of ``world_size`` ranks; else a ValueError."""
    _check_spec(spec)
    shape = check_mesh(mesh_shape, world_size)
    if len(shape) != 2:
        raise ValueError(f"a 2-D mesh has two dimensions (dp, tp), got {shape}")
    dp, tp = shape
    _check_tp(spec, tp, 1, False)
    check_positive_int("batch_size", batch_size)
    if batch_size % dp:
        raise ValueError(
            f"a batch of {batch_size} does not split over {dp} data-parallel "
            f"ranks: use a multiple of {dp}"
        )
    return dp, tp


#: What a 2-D checkpoint records of its run and a resumed run must repeat, with the words
#: that name each setting (for :func:`d2lgpu.sharding.check_resumable`). The mesh shape is
#: recorded too, but may change.
MUST_MATCH_2D = {
    "model": "model (kind, width, hidden, depth, heads, norm)",
    "batch_size": "global batch size",
    "seq_len": "sequence length",
    "lr": "learning rate",
    "optimizer": "optimizer",
    "seed": "seed",
    "precision": "precision",
}


def _recorded_2d(run: TwoDRun, precision: str) -> dict[str, Any]:
    spec = run.spec
    return {
        "model": [spec.kind, spec.width, spec.hidden, spec.depth, spec.heads, spec.norm],
        "batch_size": run.batch_size,
        "seq_len": run.seq_len,
        "lr": run.lr,
        "optimizer": "sgd, momentum 0.9",
        "seed": run.seed,
        "precision": precision,
    }


def _resume_2d(
    job: ResumableTwoDRun, model: nn.Module, opt: torch.optim.Optimizer, ctx: DistContext,
    config: dict[str, Any], mesh_shape: tuple[int, int],
) -> tuple[int, list[float], dict[str, Any]]:
    """Load the latest checkpoint under the root if there is one: (step, losses, extra)."""
    path = latest_checkpoint(job.checkpoint_root)
    if path is None:
        return 0, [], {}
    extra = read_checkpoint_extra(path)  # damage named first, before the settings
    check_resumable(extra, config, path, MUST_MATCH_2D)
    if extra["step"] >= job.two_d.steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {extra['step']} and this run ends at step "
            f"{job.two_d.steps}: nothing left to train. Ask for more steps (they count from the "
            f"start, not from the checkpoint); or, to start fresh, delete {path.parent} or "
            "pass another checkpoint directory"
        )
    load_checkpoint(path, model, opt)  # checks every file against its checksum first
    if ctx.is_main and job.log:
        print(f"resuming from {path} (step {extra['step']})", flush=True)
        saved = tuple(extra.get("mesh", ()))
        if saved != mesh_shape:
            print(f"the checkpoint was written on a mesh (dp, tp) = {saved}, this run has "
                  f"{mesh_shape}: each rank reads the pieces of the saved tensors it now holds",
                  flush=True)
    return extra["step"], list(extra["losses"]), extra


def _kill_this_rank(ctx: DistContext, step: int) -> None:
    print(f"rank {ctx.rank} is killed (SIGKILL) in step {step + 1}, after its forward; the "
          "others wait for it in backward", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _dp_slice(run: TwoDRun, step: int, dp_rank: int, dp: int, device: torch.device):
    """This data-parallel group's share of step ``step``'s batch."""
    local = run.batch_size // dp
    X, Y = run.spec.data(run.batch_size, run.seq_len, step, run.seed)
    part = slice(dp_rank * local, (dp_rank + 1) * local)
    return X[part].to(device), Y[part].to(device)


def train_2d(
    run: TwoDRun, ctx: DistContext, saving: ResumableTwoDRun | None = None
) -> TrainResult:
    """Train ``run`` on a ``(dp, tp)`` mesh of the ranks of ``ctx``; every rank calls it.

    With ``saving``, continue from its latest checkpoint and write new ones.
    """
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp = check_2d(run.spec, run.mesh_shape, ctx.world_size, run.batch_size)
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    policy = precision_policy(ctx.device, run.precision)
    model = run.spec.build(run.seed).to(ctx.device)
    model = parallelize_2d(model, run.spec, mesh, policy.dtype)
    opt = _optimizer(model.parameters(), run.lr)
    scaler = None
    if policy.use_scaler:  # fp16: agree over all ranks whether any gradient overflowed
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(ctx.device.type)
    config = _recorded_2d(run, policy.name)
    start, losses, extra = 0, [], {}
    if saving is not None:
        prepare_checkpoint_root(saving.checkpoint_root)  # before any training
        start, losses, extra = _resume_2d(saving, model, opt, ctx, config, (dp, tp))
        if scaler is not None and "scaler" in extra:
            scaler.load_state_dict(extra["scaler"])
    dp_rank = mesh["dp"].get_local_rank()
    with policy.matmul_precision():
        for step in range(start, run.steps):
            mark_progress(f"step {step + 1}")
            X, Y = _dp_slice(run, step, dp_rank, dp, ctx.device)
            loss = F.mse_loss(model(X).float(), Y)
            if saving is not None and (saving.kill_rank, saving.kill_at_step) == (ctx.rank, step):
                _kill_this_rank(ctx, step)
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / ctx.world_size)
            # The course's one divergence rule: not finite, or ten times the first loss.
            check_training_loss(losses[-1], when=f"step {step + 1}", lr=run.lr,
                                first_loss=losses[0] if len(losses) > 1 else None,
                                advice=f"try {run.lr / 10:g}")
            done = step + 1
            if saving is not None and (done % saving.save_every == 0 or done == run.steps):
                extra = {"losses": losses, "mesh": [dp, tp], "config": config}
                if scaler is not None:
                    extra["scaler"] = scaler.state_dict()
                path = save_checkpoint(saving.checkpoint_root, done, model, opt, extra)
                if ctx.is_main and saving.log:
                    print(f"step {done}/{run.steps}: loss {losses[-1]:.4f}; saved {path}",
                          flush=True)
    return _finish_2d(model, opt, losses, ctx)


def _finish_2d(
    model: nn.Module, opt: torch.optim.Optimizer, losses: list[float], ctx: DistContext
) -> TrainResult:
    """Each rank's bytes, and the full weights: the result of :func:`train_2d`."""
    params = _local_bytes(model.parameters())
    optim = _local_bytes(
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    sizes: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(sizes, (params, optim))
    # Gathering a tensor split over both dimensions takes two all-gathers, and torch >= 2.10
    # warns about it on every rank; for one gather at the end that is fine.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return TrainResult(_full_state(model), losses, {"bytes_per_rank": sizes})


def param_bytes_2d(spec: ModelSpec, dp: int, tp: int) -> int:
    """Parameter bytes on each rank of a ``(dp, tp)`` mesh after :func:`parallelize_2d` (chapter 9).

    Tensor-parallel layers are split ``tp`` ways, then every tensor ``dp`` ways; a row-parallel
    layer's bias (added after the all-reduce) and a norm's weights stay whole over ``tp``.
    Assumes every dimension divides evenly (no FSDP padding).
    """
    _check_spec(spec)
    check_positive_int("dp", dp)
    check_positive_int("tp", tp)
    split = set(tp_plan(spec))  # the names of the layers split over "tp"
    rowwise = {k for k in split if k.endswith(("fc2", "out"))}
    total = 0
    for name, p in spec.build().named_parameters():
        layer, kind = name.rsplit(".", 1)
        tp_split = layer in split and not (layer in rowwise and kind == "bias")
        total += p.numel() * p.element_size() // (dp * tp if tp_split else dp)
    return total


@dataclass(frozen=True)
class SplitRow:
    """One way to split training over devices: the formulas, and figures when sizes are given."""

    name: str
    memory: str
    traffic: str
    idle: str
    memory_gb: float = float("nan")
    traffic_gb: float = float("nan")


def split_table(
    params: float | None = None,
    width: int | None = None,
    layers: int | None = None,
    tokens: int | None = None,
    n: int = 8,
    microbatches: int = 32,
    bytes_per_number: int = 2,
    tp: int = 4,
) -> list[SplitRow]:
    """Memory, bytes sent and idle time per device for data, FSDP, pipeline, tensor and 2-D
    (chapter 9).

    Without sizes, the formulas as text, every one in bytes: P parameters (16P bytes of fp32
    Adam state), b bytes per number sent, T tokens of width W per step, L transformer layers
    of 2 tensor-parallel blocks (4L all-reduces a step: one per block in forward and one in
    backward). With them, ``memory_gb`` is each device's
    parameters, gradients and Adam state (16 bytes a parameter: fp32 weights, gradients and
    two moments) and ``traffic_gb`` the bytes each device sends in one step: gradients and
    parameters in ``bytes_per_number``-byte numbers, activations of ``tokens`` tokens (the
    whole step's batch) of ``width`` numbers at each of ``layers`` transformer layers
    (2 tensor-parallel blocks each: attention and MLP). A ring all-reduce of S bytes over
    N devices sends 2 S (N - 1) / N per device; an all-gather or a reduce-scatter half that.
    The 2-D row uses ``tp``-way tensor parallel and ``n / tp``-way FSDP.
    """
    rows = [
        SplitRow(
            "data parallel (DDP)",
            "16P + A/N",
            "all-reduce of gradients: 2bP(N-1)/N",
            "none: overlaps backward",
        ),
        SplitRow(
            "FSDP",
            "16P/N + A/N + 1 layer",
            "2 all-gathers + 1 reduce-scatter: 3bP(N-1)/N",
            "none if gathers overlap",
        ),
        SplitRow(
            "pipeline", "16P/N + A/m (1F1B)", "activations at 1 boundary: 2bTW", "(N-1)/(m+N-1)"
        ),
        SplitRow(
            "tensor parallel",
            "16P/N + A/N .. A",
            "4L all-reduces of bTW: 8LbTW(N-1)/N",
            "all-reduces not hidden",
        ),
        SplitRow(
            "2-D (FSDP x TP)",
            "16P/N + A/N .. A/dp",
            "TP within, FSDP of P/tp across",
            "TP's all-reduces",
        ),
    ]
    for name, value in (("n", n), ("microbatches", microbatches),
                        ("bytes_per_number", bytes_per_number), ("tp", tp)):
        check_positive_int(name, value)
    if params is None and (width, layers, tokens) == (None, None, None):
        return rows
    if params is None or width is None or layers is None or tokens is None:
        raise ValueError("give params, width, layers and tokens together, or none of them")
    check_positive_float("params", params)
    for name, value in (("width", width), ("layers", layers), ("tokens", tokens)):
        check_positive_int(name, value)
    check_positive_int("n", n)
    check_positive_int("tp", tp)
    if n % tp:
        raise ValueError(f"tp={tp} does not divide n={n}: use a divisor of {n}")
    b, gb = bytes_per_number, 1e9
    state = 16 * params
    act = tokens * width * b  # one layer's output for the whole batch
    ring = (n - 1) / n
    dp2 = n // tp
    traffic = [
        2 * params * b * ring,
        3 * params * b * ring,
        2 * act,
        4 * layers * 2 * act * ring,
        4 * layers * 2 * (act / dp2) * (tp - 1) / tp + 3 * params / tp * b * (dp2 - 1) / dp2,
    ]
    memory = [state, state / n, state / n, state / n, state / n]
    idle = [
        rows[0].idle,
        rows[1].idle,
        f"bubble {bubble_formula(n, microbatches):.0%} (m={microbatches})",
        rows[3].idle,
        rows[4].idle,
    ]
    return [
        SplitRow(r.name, r.memory, r.traffic, i, m / gb, t / gb)
        for r, m, t, i in zip(rows, memory, traffic, idle, strict=True)
    ]
