"""Model parallelism on CPUs (gloo) and GPUs: pipeline stages, tensor-parallel shards, a 2-D mesh.

Chapter 9's helpers. Each job is a dataclass with a ``run(ctx)`` method, so several share one
launch (:func:`d2lgpu.sharding.sharding_worker`); each training job must equal one process,
:func:`train_reference`.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from d2lgpu.models import MLPBlock
from d2lgpu.profiling import idle_gaps
from d2lgpu.runtime.checks import check_positive_int, check_training_loss
from d2lgpu.runtime.distributed import DistContext, mark_progress
from d2lgpu.sharding import CollectiveCounter, CommStats

#: Pipeline schedules by the name the jobs take: (class in torch.distributed.pipelining,
#: stages per rank). PipelineRun and BubbleRun take the first two.
_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "interleaved-zero-bubble": ("ScheduleInterleavedZeroBubble", 2),
}


def _check_schedule(name: str, choices: Sequence[str] = tuple(_SCHEDULES)) -> None:
    if name not in choices:
        raise ValueError(f"schedule must be one of {tuple(choices)}, got {name!r}")


def check_stages(n_layers: int, n_stages: int) -> int:
    """Layers per stage, if ``n_layers`` split evenly into ``n_stages``; else a ValueError
    (chapter 9)."""
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


def check_microbatches(batch_size: int, n_microbatches: int) -> int:
    """The microbatch size, if ``n_microbatches`` divide ``batch_size``; else a ValueError
    (chapter 9)."""
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
    shape = tuple(shape)
    if math.prod(shape) != world_size:
        example = f" (e.g. (2, {world_size // 2}) for 2-way data parallel)"
        raise ValueError(
            f"a mesh of shape {shape} has {math.prod(shape)} places but there are {world_size} "
            f"ranks: choose dimensions whose product is {world_size}"
            f"{example if world_size % 2 == 0 else ''}"
        )
    return shape


def bubble_formula(n_stages: int, n_microbatches: int) -> float:
    """The idle fraction of a GPipe or 1F1B step, (p - 1) / (m + p - 1), for equal stages
    (chapter 9)."""
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


class Attention(nn.Module):
    """``x + out(softmax(q k^T / sqrt(d)) v)`` over ``heads`` heads, no mask, no norm.

    The heads are found from the local width (``view(..., -1, head_dim)``), so the same
    code runs on a tensor-parallel shard that holds some of the heads.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))

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
    if a.keys() != b.keys():
        raise ValueError(f"different keys: {sorted(set(a) ^ set(b))}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


class _SavedPeak:
    """Bytes autograd holds for backward, now (``live``) and at the ``peak``.

    Unlike :class:`d2lgpu.precision.SavedActivations`, which sums every storage saved, it
    counts a tensor off when autograd drops it after its backward: the peak is what a
    pipeline schedule decides. Parameters are not activations and are not counted.
    """

    def __init__(self, params) -> None:
        self.live = self.peak = 0
        self._params = {p.data_ptr() for p in params}

    def _pack(self, t: torch.Tensor):
        if t.data_ptr() in self._params:
            return t
        return _Held(self, t, t.numel() * t.element_size())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _Held.unpack)


class _Held:
    def __init__(self, counter: _SavedPeak, tensor: torch.Tensor, nbytes: int) -> None:
        self.counter, self.tensor, self.nbytes = counter, tensor, nbytes
        counter.live += nbytes
        counter.peak = max(counter.peak, counter.live)

    def __del__(self) -> None:
        self.counter.live -= self.nbytes

    @staticmethod
    def unpack(held: _Held | torch.Tensor) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held


class _FunctionalCollectiveCounter(CollectiveCounter):
    """:class:`d2lgpu.sharding.CollectiveCounter`, also counting the functional collectives
    DTensor issues (``_c10d_functional``); sizes are full (unsharded) payloads."""

    _KINDS = {
        "all_reduce": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
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


def _fix_torch29_first_exchange(stage: Any) -> Any:
    """Make ``stage``'s first exchange with its neighbours work on gloo under torch 2.9,
    which sends an int64 into a float32 buffer (gloo: "8 vs 4. Received data size doesn't
    match"). Later torch sends a float32 there or has no such exchange."""
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


def _schedule(modules: Sequence[nn.Module], name: str, n_microbatches: int, ctx: DistContext):
    """Schedule ``name`` over this rank's stages: rank r holds stages r, r + p, ..."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    # torch 2.9 refuses fewer microbatches than stages in every single-stage schedule, later
    # versions only in Schedule1F1B: refuse it on every version, with the fix named.
    if n_microbatches < ctx.world_size:
        raise ValueError(
            f"a pipeline of {ctx.world_size} stages needs at least {ctx.world_size} "
            f"microbatches, got {n_microbatches}: use more microbatches (or fewer stages)"
        )
    n_stages = ctx.world_size * len(modules)
    stages = [
        _fix_torch29_first_exchange(
            PipelineStage(module, ctx.rank + k * ctx.world_size, n_stages, ctx.device)
        )
        for k, module in enumerate(modules)
    ]
    cls = getattr(pipelining, _SCHEDULES[name][0])
    return cls(stages[0] if len(stages) == 1 else stages, n_microbatches, loss_fn=F.mse_loss)


def _pipeline_step(schedule, X, Y, ctx: DistContext) -> list[torch.Tensor]:
    """One step: the first rank feeds the batch in, the last computes the losses."""
    losses: list[torch.Tensor] = []
    args = (X,) if ctx.rank == 0 else ()
    kwargs = {"target": Y, "losses": losses} if ctx.rank == ctx.world_size - 1 else {}
    schedule.step(*args, **kwargs)
    return losses


@dataclass(frozen=True)
class PipelineRun:
    """Train ``spec`` for ``steps`` steps as a pipeline of one stage per rank (chapter 9).

    ``extra["activation_peak"]``: each stage's peak of saved activations, in bytes.
    """

    spec: ModelSpec = ModelSpec()
    batch_size: int = 16
    seq_len: int = 8
    n_microbatches: int = 4
    schedule: str = "1f1b"
    steps: int = 2
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        check_microbatches(self.batch_size, self.n_microbatches)
        _check_schedule(self.schedule, ("gpipe", "1f1b"))

    def run(self, ctx: DistContext) -> TrainResult:
        model = self.spec.build(self.seed)
        stage = split_stages(model, ctx.world_size)[ctx.rank].to(ctx.device)
        schedule = _schedule([stage], self.schedule, self.n_microbatches, ctx)
        opt = _optimizer(stage.parameters(), self.lr)
        counter = _SavedPeak(stage.parameters())
        losses = []
        for step in range(self.steps):
            X, Y = (t.to(ctx.device)
                    for t in self.spec.data(self.batch_size, self.seq_len, step, self.seed))
            with counter.hooks():
                mb_losses = _pipeline_step(schedule, X, Y, ctx)
            opt.step()
            opt.zero_grad()
            losses.append(torch.stack(mb_losses).mean().item() if mb_losses else float("nan"))
        # A slice of an nn.Sequential keeps the layers' names ("2.fc1.weight"): the whole
        # model's state dict is the union of the stages'.
        local = {k: v.detach().cpu().clone() for k, v in stage.state_dict().items()}
        parts: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(parts, (local, counter.peak, losses))
        state = {k: v for part, _, _ in parts for k, v in part.items()}
        return TrainResult(state, parts[-1][2], {"activation_peak": [p for _, p, _ in parts]})


def _synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``: a host clock around GPU work otherwise
    measures only the launches (with NCCL, ``work.wait()`` does not wait either)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait_for(tensor: torch.Tensor) -> None:
    """Make the host wait until ``tensor`` is ready on its device. Under NCCL a received
    tensor's ``Work.wait()`` makes only the stream wait: a stage whose cost is host time (a
    sleep) would start before its input arrived, and the bubble would read about 0."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


@dataclass(frozen=True)
class ScheduleTiming:
    """Timed pipeline steps of one schedule, one per number of microbatches.

    ``events[i]`` is the timeline of the step of ``n_microbatches[i]``: one
    ``(rank, stage, kind, microbatch, start, end)`` per piece of work, in seconds from the
    start of the step; ``busy_seconds[i][rank]`` sums them per rank. ``unit_s`` is the
    time of one forward of one microbatch on fixed-cost stages.
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
        """The idle time in gaps of at least half a piece of work (a rank waiting for its
        neighbour), as a fraction of the step, averaged over the ranks. The shorter gaps
        are the cost of each message: sending it and waking the process that waits."""
        min_gap = self.unit_s / _SCHEDULES[self.schedule][1] / 2
        out = []
        for events, step in zip(self.events, self.step_seconds, strict=True):
            idle = [idle_gaps([(a, b) for r, *_, a, b in events if r == rank], 0.0, step, min_gap)
                    for rank in range(self.n_ranks)]
            out.append(statistics.fmean(sum(b - a for a, b in gaps) / step for gaps in idle))
        return out

    @property
    def formula(self) -> list[float]:
        return [schedule_bubble_formula(self.schedule, self.n_ranks, m)
                for m in self.n_microbatches]

    def piece_seconds(self, index: int, kind: str) -> list[list[float]]:
        """``[rank][microbatch]``: how long each ``kind`` piece of step ``index`` took, with
        one stage per rank."""
        out = [[0.0] * self.n_microbatches[index] for _ in range(self.n_ranks)]
        for rank, _, k, mb, start, end in self.events[index]:
            if k == kind:
                out[rank][mb] = end - start
        return out


def _time_steps(stages: Sequence[nn.Module], step: Callable[[], Any], repeats: int,
                ctx: DistContext) -> list[tuple[float, float, list]]:
    """``repeats`` steps run by every rank at once; of each, the seconds from the first start
    to the last end, that start on ``time.perf_counter()``'s clock, and each rank's events."""
    records = []
    for _ in range(repeats):
        for stage in stages:
            stage.events.clear()
            stage.zero_grad()
        _synchronize(ctx.device)
        dist.barrier()
        start = time.perf_counter()
        step()
        _synchronize(ctx.device)
        end = time.perf_counter()
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, (start, end, [e for s in stages for e in s.events]))
        t0 = min(g[0] for g in gathered)
        records.append((max(g[1] for g in gathered) - t0, t0, [g[2] for g in gathered]))
    return records


def _timing(schedule: str, unit_s: float, n_microbatches: Sequence[int], kept: list,
            ctx: DistContext) -> ScheduleTiming:
    """The kept step of each ``m`` as a timeline (each stage takes its microbatches in order)."""
    steps, busy, timelines = [], [], []
    for step_s, t0, gathered in kept:
        timeline = []
        for rank, events in enumerate(gathered):
            seen: Counter[tuple[int, str]] = Counter()
            for index, kind, a, b in sorted(events, key=lambda e: e[2]):
                timeline.append((rank, index, kind, seen[index, kind], a - t0, b - t0))
                seen[index, kind] += 1
        steps.append(step_s)
        busy.append([sum(b - a for *_, a, b in events) for events in gathered])
        timelines.append(timeline)
    return ScheduleTiming(schedule, ctx.world_size, unit_s, list(n_microbatches), steps, busy,
                          timelines)


class _TimedStage(nn.Module):
    """``module`` as pipeline stage ``index``, recording when each forward and backward ran.

    A backward ("B") begins when the gradient of the stage's output arrives and ends with
    the last weight gradient accumulated (the first stage computes no input gradient).
    """

    def __init__(self, module: nn.Module, index: int, device: torch.device) -> None:
        super().__init__()
        self.module, self.index, self.device = module, index, device
        self.events: list[tuple[int, str, float, float]] = []
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._backward_goes_on)

    def _now(self) -> float:
        _synchronize(self.device)
        return time.perf_counter()

    def _backward_starts(self, grad: torch.Tensor) -> None:
        _wait_for(grad)  # the gradient of the output has arrived
        now = self._now()
        self.events.append((self.index, "B", now, now))

    def _backward_goes_on(self, _param: torch.Tensor) -> None:
        index, kind, start, _ = self.events[-1]  # the backward running now
        self.events[-1] = (index, kind, start, self._now())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self._now()
        out = self.module(x)
        self.events.append((self.index, "F", start, self._now()))
        out.register_hook(self._backward_starts)
        return out


@dataclass(frozen=True)
class BubbleRun:
    """Time GPipe steps of real stages (the model's blocks) for each number of
    microbatches of a fixed size (chapter 9).

    Each stage records when its forward ("F") and its backward ("B") of each microbatch
    began and ended: what is left of the step is idle, the bubble plus the messages.
    ``repeats`` steps per ``m``; the one of median length is kept.
    """

    spec: ModelSpec = ModelSpec(width=256, hidden=1024, depth=4)
    microbatch_size: int = 8
    seq_len: int = 16
    n_microbatches: tuple[int, ...] = (2, 4, 8, 16)
    repeats: int = 5

    def run(self, ctx: DistContext) -> ScheduleTiming:
        blocks = split_stages(self.spec.build(0), ctx.world_size)[ctx.rank]
        stage = _TimedStage(blocks.to(ctx.device), ctx.rank, ctx.device)
        kept = []
        for m in self.n_microbatches:
            X, Y = (t.to(ctx.device)
                    for t in self.spec.data(m * self.microbatch_size, self.seq_len, 0))
            step = partial(_pipeline_step, _schedule([stage], "gpipe", m, ctx), X, Y, ctx)
            step()  # warm-up: the first step also sets up buffers
            records = sorted(_time_steps([stage], step, self.repeats, ctx), key=lambda r: r[0])
            kept.append(records[len(records) // 2])
        return _timing("gpipe", float("nan"), self.n_microbatches, kept, ctx)


def schedule_bubble_formula(name: str, n_ranks: int, n_microbatches: int) -> float:
    """The idle fraction of a step of schedule ``name`` when every stage costs the same:
    (p - 1) / (v m + p - 1) with v stages per rank; zero-bubble's weight gradients (W), which
    nothing waits for, fill the gaps, leaving a third: (p - 1) / (3 v m + p - 1)."""
    _check_schedule(name)
    p, m, v = n_ranks, n_microbatches, _SCHEDULES[name][1]
    if name == "interleaved-zero-bubble":
        return (p - 1) / (3 * v * m + p - 1)
    return (p - 1) / (v * m + p - 1)


class _Cost(torch.autograd.Function):
    """Identity forward; a backward that waits for its gradient, sleeps ``seconds`` and
    records when it ran."""

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
    ``input_s`` for the gradient of its input (I) and ``weight_s`` for its weight's (W)
    (chapter 9).

    It sleeps instead of computing and records each piece in ``events`` as ``(stage_index,
    kind, start, end)`` on ``time.perf_counter()``'s clock. The output equals the input.
    """

    def __init__(self, stage_index: int, forward_s: float, input_s: float, weight_s: float):
        super().__init__()
        self.stage_index = stage_index
        self.costs = {"F": forward_s, "I": input_s, "W": weight_s}
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
        _check_schedule(self.schedule)

    def run(self, ctx: DistContext) -> ScheduleTiming:
        v = _SCHEDULES[self.schedule][1]
        stages = [FixedCostStage(ctx.rank + k * ctx.world_size, 0.0, 0.0, 0.0).to(ctx.device)
                  for k in range(v)]
        kept = []
        for m in self.n_microbatches:
            X = torch.ones(2 * m, 16, device=ctx.device)
            schedule = _schedule(stages, self.schedule, m, ctx)
            step = partial(_pipeline_step, schedule, X, torch.zeros_like(X), ctx)
            for stage in stages:  # set the stages up (shapes, buffers) at no cost
                stage.costs = dict.fromkeys("FIW", 0.0)
            step()
            for stage in stages:
                stage.costs = dict.fromkeys("FIW", self.unit_s / v)
            kept.append(min(_time_steps(stages, step, self.repeats, ctx), key=lambda r: r[0]))
        return _timing(self.schedule, self.unit_s, self.n_microbatches, kept, ctx)


_KIND_COLORS = {"F": "tab:blue", "I": "tab:orange", "W": "tab:green"}


def plot_pipeline_timeline(timing: ScheduleTiming, index: int = 0, ax=None):
    """A Gantt chart of step ``index`` of ``timing``: one row per rank, one bar per piece of
    work (F forward, I input gradient, W weight gradient, labelled with the microbatch);
    the white gaps are the idle time (chapter 9)."""
    from matplotlib.patches import Patch

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
    ax.set_title(f"{timing.schedule}, {timing.n_ranks} ranks, m = {m}: bubble "
                 f"{timing.bubble_fraction[index]:.0%} (formula "
                 f"{timing.formula[index]:.0%}), all idle {timing.idle_fraction[index]:.0%}",
                 fontsize=9)
    names = {"F": "forward", "I": "input gradient", "W": "weight gradient"}
    ax.legend(handles=[Patch(color=c, label=names[k]) for k, c in _KIND_COLORS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    return ax


def tp_plan(spec: ModelSpec, sequence_parallel: bool = False) -> dict[str, Any]:
    """``parallelize_module``'s plan for every block of ``spec.build()``: the first matmuls
    column-wise, the last row-wise (Megatron). With ``sequence_parallel`` the activations
    between blocks stay split along the sequence (reduce-scatter, then all-gather)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    offset = 1 if spec.norm else 0
    first = ("fc1",) if spec.kind == "mlp" else ("q", "k", "v")
    last = "fc2" if spec.kind == "mlp" else "out"
    column = ColwiseParallel(input_layouts=Shard(1)) if sequence_parallel else ColwiseParallel()
    row = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan: dict[str, Any] = {}
    if spec.norm and sequence_parallel:
        plan["0"] = SequenceParallel(use_local_output=True)
    for i in range(offset, offset + spec.depth):
        plan.update({f"{i}.{name}": column for name in first})
        plan[f"{i}.{last}"] = row
    return plan


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in model.state_dict().items()}


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _check_tp(spec: ModelSpec, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    split = spec.hidden if spec.kind == "mlp" else spec.heads
    what = "hidden units" if spec.kind == "mlp" else "heads"
    if split % tp:
        raise ValueError(
            f"{split} {what} do not split over {tp} tensor-parallel ranks: use a multiple of {tp}"
        )
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"a sequence of {seq_len} does not split over {tp} ranks: use a multiple")


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
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        _check_tp(self.spec, ctx.world_size, self.seq_len, self.sequence_parallel)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        model = self.spec.build(self.seed).to(ctx.device)
        parallelize_module(model, mesh, tp_plan(self.spec, self.sequence_parallel))
        opt = _optimizer(model.parameters(), self.lr)
        losses, comm = [], {}
        part = slice(ctx.rank * self.seq_len // ctx.world_size,
                     (ctx.rank + 1) * self.seq_len // ctx.world_size)
        for step in range(self.steps):
            X, Y = (t.to(ctx.device)
                    for t in self.spec.data(self.batch_size, self.seq_len, step, self.seed))
            if self.sequence_parallel:  # each rank holds its part of the sequence
                X, Y = X[:, part], Y[:, part]
            with _FunctionalCollectiveCounter() as counter:
                loss = F.mse_loss(model(X), Y)
                if self.sequence_parallel:
                    # Each rank's loss is the mean over its part of the sequence; the mean
                    # over the whole is their average, and the collectives sum the gradients.
                    loss = loss / ctx.world_size
                loss.backward()
            if step == 0:
                comm = {k: (s.calls, s.nbytes) for k, s in counter.stats.items()}
            opt.step()
            opt.zero_grad()
            if self.sequence_parallel:
                loss = loss.detach().clone()
                dist.all_reduce(loss)
            losses.append(loss.item())
        return TrainResult(_full_state(model), losses, {"comm": comm})


@dataclass(frozen=True)
class TwoDRun:
    """FSDP2 over mesh dimension ``dp`` and tensor parallel over ``tp``: ``mesh_shape = (dp, tp)``
    (chapter 9).

    The batch is split over ``dp``. With ``param_dtype`` (bf16 or fp16) the blocks compute in
    it and reduce gradients in fp32. ``extra["bytes_per_rank"]``: each rank's parameter and
    optimizer bytes.
    """

    spec: ModelSpec = ModelSpec()
    mesh_shape: tuple[int, int] = (2, 2)
    batch_size: int = 8
    seq_len: int = 8
    steps: int = 2
    lr: float = 0.05
    seed: int = 0
    param_dtype: torch.dtype | None = None

    def run(self, ctx: DistContext) -> TrainResult:
        return train_2d(self, ctx)


def parallelize_2d(
    model: nn.Module, spec: ModelSpec, mesh, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """Tensor parallel over ``mesh["tp"]``, then ``fully_shard`` each block and the root over
    ``mesh["dp"]``: the order FSDP2 needs (it shards the DTensors TP made). With
    ``param_dtype`` (bf16 or fp16) the blocks compute in it and reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], tp_plan(spec))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    return model


def check_2d(
    spec: ModelSpec, mesh_shape: Sequence[int], world_size: int, batch_size: int
) -> tuple[int, int]:
    """``(dp, tp)`` if ``spec`` trains on that mesh of ``world_size`` ranks; else a ValueError."""
    shape = check_mesh(mesh_shape, world_size)
    if len(shape) != 2:
        raise ValueError(f"a 2-D mesh has two dimensions (dp, tp), got {shape}")
    dp, tp = shape
    _check_tp(spec, tp, 1, False)
    if batch_size % dp:
        raise ValueError(
            f"a batch of {batch_size} does not split over {dp} data-parallel "
            f"ranks: use a multiple of {dp}"
        )
    return dp, tp


def train_2d(run: TwoDRun, ctx: DistContext, checkpoints: Any = None) -> TrainResult:
    """Train ``run`` on a ``(dp, tp)`` mesh of the ranks of ``ctx``; every rank calls it.

    ``checkpoints`` (:mod:`d2lgpu.model_parallel_train`'s) resumes the run before its first
    step, and is called after every forward and every step.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    dp, tp = check_2d(run.spec, run.mesh_shape, ctx.world_size, run.batch_size)
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize_2d(run.spec.build(run.seed).to(ctx.device), run.spec, mesh,
                           run.param_dtype)
    opt = _optimizer(model.parameters(), run.lr)
    # fp16: the scaler agrees over all ranks whether any gradient overflowed.
    scaler = ShardedGradScaler(ctx.device.type, enabled=run.param_dtype == torch.float16)
    start, losses = 0, []
    if checkpoints is not None:
        start, losses = checkpoints.resume(model, opt, scaler, ctx)
    dp_rank, local = mesh["dp"].get_local_rank(), run.batch_size // dp
    rows = slice(dp_rank * local, (dp_rank + 1) * local)  # this dp group's share of a batch
    for step in range(start, run.steps):
        mark_progress(f"step {step + 1}")
        X, Y = run.spec.data(run.batch_size, run.seq_len, step, run.seed)
        loss = F.mse_loss(model(X[rows].to(ctx.device)).float(), Y[rows].to(ctx.device))
        if checkpoints is not None:
            checkpoints.after_forward(step, ctx)
        scaler.scale(loss).backward()
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
        if checkpoints is not None:
            checkpoints.after_step(step + 1, model, opt, scaler, losses, ctx)
    sizes: list[Any] = [None] * ctx.world_size
    optim = (v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    dist.all_gather_object(sizes, (_local_bytes(model.parameters()), _local_bytes(optim)))
    # Gathering a tensor split over both dimensions takes two all-gathers, and torch >= 2.10
    # warns about it on every rank; for one gather at the end that is fine.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return TrainResult(_full_state(model), losses, {"bytes_per_rank": sizes})


def param_bytes_2d(spec: ModelSpec, dp: int, tp: int) -> int:
    """Parameter bytes on each rank of a ``(dp, tp)`` mesh after :func:`parallelize_2d`, with
    no padding (chapter 9): a row-parallel bias and a norm stay whole over ``tp``."""
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


_SPLITS = [
    SplitRow("data parallel (DDP)", "16P + A/N", "all-reduce of gradients: 2bP(N-1)/N",
             "none: overlaps backward"),
    SplitRow("FSDP", "16P/N + A/N + 1 layer", "2 all-gathers + 1 reduce-scatter: 3bP(N-1)/N",
             "none if gathers overlap"),
    SplitRow("pipeline", "16P/N + A/m (1F1B)", "activations at 1 boundary: 2bTW",
             "(N-1)/(m+N-1)"),
    SplitRow("tensor parallel", "16P/N + A/N .. A", "4L all-reduces of bTW: 8LbTW(N-1)/N",
             "all-reduces not hidden"),
    SplitRow("2-D (FSDP x TP)", "16P/N + A/N .. A/dp", "TP within, FSDP of P/tp across",
             "TP's all-reduces"),
]


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
    (chapter 9): the formulas, and with sizes each device's GB of Adam state and GB sent a step.

    P parameters (16 bytes each in fp32 Adam), b bytes per number sent, T tokens of width W,
    L layers of 2 tensor-parallel blocks; the 2-D row is ``tp``-way TP and ``n / tp``-way FSDP.
    """
    if params is None and (width, layers, tokens) == (None, None, None):
        return list(_SPLITS)
    if params is None or width is None or layers is None or tokens is None:
        raise ValueError("give params, width, layers and tokens together, or none of them")
    if n % tp:
        raise ValueError(f"tp={tp} does not divide n={n}: use a divisor of {n}")
    b = bytes_per_number
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
    memory = [16 * params] + [16 * params / n] * 4
    idle = [r.idle for r in _SPLITS]
    idle[2] = f"bubble {bubble_formula(n, microbatches):.0%} (m={microbatches})"
    return [SplitRow(r.name, r.memory, r.traffic, i, m / 1e9, t / 1e9)
            for r, m, t, i in zip(_SPLITS, memory, traffic, idle, strict=True)]
