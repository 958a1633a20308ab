"""Chapter 9's model parallelism on CPUs (gloo) and GPUs: pipeline, tensor parallel, a 2-D mesh.
Each job has a ``run(ctx)``, so several share one launch; each trainer equals train_reference."""

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
from d2lgpu.sharding import CollectiveCounter, CommStats, dtype_name, full_cpu_state
from d2lgpu.timing import synchronize

#: Pipeline schedules by name: (class in torch.distributed.pipelining, stages per rank).
_SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
              "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
              "interleaved-zero-bubble": ("ScheduleInterleavedZeroBubble", 2)}


def _check_schedule(name: str, choices: Sequence[str] = tuple(_SCHEDULES)) -> None:
    if name not in choices:
        raise ValueError(f"schedule must be one of {tuple(choices)}, got {name!r}")


def check_stages(n_layers: int, n_stages: int) -> int:
    """Layers per stage, if ``n_layers`` split evenly into ``n_stages`` (chapter 9)."""
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} pipeline stages for {n_layers} layers: every stage needs at "
                         f"least one layer, so use at most {n_layers} ranks or a deeper model")
    if n_layers % n_stages:
        raise ValueError(f"{n_layers} layers do not split evenly into {n_stages} stages: use a "
                         f"depth that is a multiple of {n_stages}, or a number of ranks that "
                         f"divides {n_layers}")
    return n_layers // n_stages


def check_microbatches(batch_size: int, n_microbatches: int) -> int:
    """The microbatch size, if ``n_microbatches`` divide ``batch_size`` (chapter 9)."""
    if batch_size % n_microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(f"a batch of {batch_size} does not split into {n_microbatches} equal "
                         f"microbatches: use a number of microbatches that divides it ({divisors}) "
                         f"or a batch size that is a multiple of {n_microbatches}")
    return batch_size // n_microbatches


def check_mesh(shape: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``shape`` as a tuple, if its product is ``world_size`` (chapter 9)."""
    shape = tuple(shape)
    if math.prod(shape) != world_size:
        example = f" (e.g. (2, {world_size // 2}) for 2-way data parallel)"
        raise ValueError(f"a mesh of shape {shape} has {math.prod(shape)} places but there are "
                         f"{world_size} ranks: choose dimensions whose product is {world_size}"
                         f"{example if world_size % 2 == 0 else ''}")
    return shape


def bubble_formula(n_stages: int, n_microbatches: int) -> float:
    """(p - 1) / (m + p - 1): the idle fraction of a GPipe or 1F1B step (chapter 9)."""
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


class Attention(nn.Module):
    """``x + out(softmax(q k^T / sqrt(d)) v)``, no mask, no norm. The heads come from the local
    width (``view(..., -1, head_dim)``), so a tensor-parallel shard of some heads runs it too."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        B, S, _ = X.shape
        q, k, v = (lin(X).view(B, S, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v)
        return X + self.out(a.transpose(1, 2).reshape(B, S, -1))


@dataclass(frozen=True)
class ModelSpec:
    """A stack of ``depth`` MLP or attention blocks of width ``width`` (chapter 9)."""

    width: int = 64
    hidden: int = 256
    depth: int = 4
    kind: str = "mlp"
    heads: int = 4
    norm: bool = False  # a LayerNorm first: sequence parallelism's layer that is no matmul

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
        mlp = self.kind == "mlp"
        blocks = [MLPBlock(self.width, self.hidden) if mlp else Attention(self.width, self.heads)
                  for _ in range(self.depth)]
        return nn.Sequential(*([nn.LayerNorm(self.width)] if self.norm else []), *blocks)

    def data(self, batch_size: int, seq_len: int, step: int, seed: int = 0, device=None):
        """Inputs ``[B, S, width]`` and targets of one step, the same on every rank."""
        gen = torch.Generator().manual_seed(seed * 7919 + step)
        return [torch.randn(batch_size, seq_len, self.width, generator=gen).to(device)
                for _ in range(2)]


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


def train_reference(spec: ModelSpec, batch_size: int, seq_len: int, steps: int,
                    lr: float) -> TrainResult:
    """One process, the whole model and batch: what every parallel run must equal (chapter 9)."""
    model = spec.build()
    opt = _optimizer(model.parameters(), lr)
    losses = []
    for step in range(steps):
        X, Y = spec.data(batch_size, seq_len, step)
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


class _SavedPeak(torch.autograd.graph.saved_tensors_hooks):
    """Activation bytes autograd holds inside ``with``, now (``live``) and at the ``peak``: unlike
    precision's SavedActivations, a tensor is counted off when autograd drops it."""

    def __init__(self, params) -> None:
        self.live = self.peak = 0
        self._params = {p.data_ptr() for p in params}
        super().__init__(self._pack, _Held.unpack)

    def _pack(self, t: torch.Tensor):
        return t if t.data_ptr() in self._params else _Held(self, t, t.nbytes)


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
    """CollectiveCounter, also counting DTensor's functional collectives at their full size."""

    _KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kind = self._KINDS.get(func.__name__.split(".")[0])
        if func.namespace != "_c10d_functional" or kind is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        # all_gather's output is the group's size (args[1]) times its input
        nbytes = args[0].nbytes * (args[1] if kind == "all_gather" else 1)
        self.stats.setdefault(kind, CommStats()).add(nbytes, args[0].dtype)
        return func(*args, **(kwargs or {}))


def _fix_torch29_first_exchange(stage: Any) -> Any:
    """Torch 2.9's stage sends an int64 into a float32 buffer in its first exchange, which gloo
    refuses ("8 vs 4. Received data size doesn't match"): send floats. Later torch does."""
    make_ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)

    def float_ops() -> list[Any]:
        ops = make_ops()
        for op in ops:
            op.tensor = op.tensor.float()
        return ops

    if make_ops is not None:
        stage._get_init_p2p_neighbors_ops = float_ops
    return stage


def _schedule(modules: Sequence[nn.Module], name: str, n_microbatches: int, ctx: DistContext):
    """Schedule ``name`` over this rank's stages: rank r holds stages r, r + p, ..."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    # torch 2.9 refuses fewer microbatches than stages in every single-stage schedule, later
    # versions only in Schedule1F1B: refuse it on every version, with the fix named.
    if n_microbatches < ctx.world_size:
        raise ValueError(f"a pipeline of {ctx.world_size} stages needs at least {ctx.world_size} "
                         f"microbatches, got {n_microbatches}: use more microbatches (or fewer "
                         "stages)")
    n_stages = ctx.world_size * len(modules)
    stages = [_fix_torch29_first_exchange(PipelineStage(module, ctx.rank + k * ctx.world_size,
                                                        n_stages, ctx.device))
              for k, module in enumerate(modules)]
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
    """Train ``spec`` as a pipeline of one stage per rank (chapter 9); ``extra["activation_peak"]``
    holds each stage's peak of saved activations, in bytes."""

    spec: ModelSpec = ModelSpec()
    batch_size: int = 16
    seq_len: int = 8
    n_microbatches: int = 4
    schedule: str = "1f1b"
    steps: int = 2
    lr: float = 0.05

    def __post_init__(self) -> None:
        check_microbatches(self.batch_size, self.n_microbatches)
        _check_schedule(self.schedule, ("gpipe", "1f1b"))

    def run(self, ctx: DistContext) -> TrainResult:
        stage = split_stages(self.spec.build(), ctx.world_size)[ctx.rank].to(ctx.device)
        schedule = _schedule([stage], self.schedule, self.n_microbatches, ctx)
        opt = _optimizer(stage.parameters(), self.lr)
        counter = _SavedPeak(stage.parameters())
        losses = []
        for step in range(self.steps):
            X, Y = self.spec.data(self.batch_size, self.seq_len, step, device=ctx.device)
            with counter:
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


@dataclass(frozen=True)
class ScheduleTiming:
    """Timed pipeline steps of one schedule, one per number of microbatches (chapter 9): in
    ``events[i]``, one ``(rank, stage, kind, microbatch, start, end)`` per piece of work, in seconds
    from the step's start. ``unit_s`` is one forward of one microbatch on fixed-cost stages."""

    schedule: str
    n_ranks: int
    unit_s: float
    n_microbatches: list[int]
    step_seconds: list[float]
    events: list[list[tuple[int, int, str, int, float, float]]]

    @property
    def idle_fraction(self) -> list[float]:
        """1 - busy / step time, averaged over the ranks: all the time a rank did not work."""
        return [1 - sum(b - a for *_, a, b in events) / self.n_ranks / step
                for events, step in zip(self.events, self.step_seconds, strict=True)]

    @property
    def bubble_fraction(self) -> list[float]:
        """Idle time in gaps of at least half a piece of work (waiting for a neighbour) per step,
        averaged over the ranks; the shorter gaps are each message's cost."""
        min_gap = self.unit_s / _SCHEDULES[self.schedule][1] / 2
        out = []
        for events, step in zip(self.events, self.step_seconds, strict=True):
            idle = [idle_gaps([(a, b) for r, *_, a, b in events if r == rank], 0.0, step, min_gap)
                    for rank in range(self.n_ranks)]
            out.append(statistics.fmean(sum(b - a for a, b in gaps) / step for gaps in idle))
        return out

    @property
    def formula(self) -> list[float]:
        """(p - 1) / (v m + p - 1) with v stages per rank of equal cost; zero-bubble's weight
        gradients fill the gaps, leaving (p - 1) / (3 v m + p - 1)."""
        v = _SCHEDULES[self.schedule][1] * (3 if self.schedule == "interleaved-zero-bubble" else 1)
        return [bubble_formula(self.n_ranks, v * m) for m in self.n_microbatches]

    def piece_seconds(self, index: int, kind: str) -> list[list[float]]:
        """``[rank][microbatch]``: how long each ``kind`` piece of step ``index`` took."""
        out = [[0.0] * self.n_microbatches[index] for _ in range(self.n_ranks)]
        for rank, _, k, mb, start, end in self.events[index]:
            if k == kind:
                out[rank][mb] = end - start
        return out


def _time_steps(stages: Sequence[nn.Module], step: Callable[[], Any], repeats: int,
                ctx: DistContext) -> list[tuple[float, list]]:
    """``repeats`` steps run by every rank at once: of each, the seconds from the first start to
    the last end, and its timeline (each stage takes its microbatches in order)."""
    records = []
    for _ in range(repeats):
        for stage in stages:
            stage.events.clear()
            stage.zero_grad()
        synchronize(ctx.device)
        dist.barrier()
        start = time.perf_counter()
        step()
        synchronize(ctx.device)
        gathered: list[Any] = [None] * ctx.world_size
        events = [e for s in stages for e in s.events]
        dist.all_gather_object(gathered, (start, time.perf_counter(), events))
        t0 = min(g[0] for g in gathered)
        timeline = []
        for rank, (_, _, events) in enumerate(gathered):
            seen: Counter[tuple[int, str]] = Counter()
            for index, kind, a, b in sorted(events, key=lambda e: e[2]):
                timeline.append((rank, index, kind, seen[index, kind], a - t0, b - t0))
                seen[index, kind] += 1
        records.append((max(g[1] for g in gathered) - t0, timeline))
    return records


class _TimedStage(nn.Module):
    """``module`` as pipeline stage ``index``, recording when each forward ("F") and backward
    ("B": from its output's gradient to its last weight gradient) ran."""

    def __init__(self, module: nn.Module, index: int, device: torch.device) -> None:
        super().__init__()
        self.module, self.index, self.device = module, index, device
        self.events: list[tuple[int, str, float, float]] = []
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._backward_goes_on)

    def _now(self) -> float:
        # Under NCCL a received tensor's Work.wait() makes only the stream wait, and a host
        # clock around GPU work reads only the launches: wait for the device.
        synchronize(self.device)
        return time.perf_counter()

    def _backward_starts(self, grad: torch.Tensor) -> None:
        now = self._now()
        self.events.append((self.index, "B", now, now))

    def _backward_goes_on(self, _param: torch.Tensor) -> None:
        index, kind, start, _ = self.events[-1]  # the backward running now
        self.events[-1] = (index, kind, start, self._now())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self._now()
        out = self.module(x)
        self.events.append((self.index, "F", start, self._now()))
        if out.requires_grad:  # torch 2.9's schedules first run a forward without autograd
            out.register_hook(self._backward_starts)
        return out


@dataclass(frozen=True)
class BubbleRun:
    """Time GPipe steps of real stages (the model's blocks) for each number of microbatches of
    a fixed size, keeping the median of ``repeats`` steps per ``m`` (chapter 9)."""

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
            X, Y = self.spec.data(m * self.microbatch_size, self.seq_len, 0, device=ctx.device)
            step = partial(_pipeline_step, _schedule([stage], "gpipe", m, ctx), X, Y, ctx)
            step()  # warm-up: the first step also sets up buffers
            records = sorted(_time_steps([stage], step, self.repeats, ctx), key=lambda r: r[0])
            kept.append(records[len(records) // 2])
        return ScheduleTiming("gpipe", ctx.world_size, float("nan"), list(self.n_microbatches),
                              [s for s, _ in kept], [t for _, t in kept])


class _Cost(torch.autograd.Function):
    """Identity forward; backward waits for its gradient, sleeps ``seconds`` and records when."""

    @staticmethod
    def forward(ctx, x, seconds, record, kind):  # type: ignore[override]
        ctx.seconds, ctx.record, ctx.kind = seconds, record, kind
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        synchronize(grad.device)
        start = time.perf_counter()
        time.sleep(ctx.seconds)
        ctx.record(ctx.kind, start, time.perf_counter())
        return grad.contiguous(), None, None, None


class FixedCostStage(nn.Module):
    """A pipeline stage that sleeps instead of computing (chapter 9): ``forward_s`` in forward,
    ``input_s`` for its input's gradient (I), ``weight_s`` for its weight's (W). It records each
    piece in ``events`` as ``(stage_index, kind, start, end)``; the output equals the input."""

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
        # Under NCCL the received input is ready on the stream, not yet for the host's sleep.
        synchronize(x.device)
        start = time.perf_counter()
        time.sleep(self.costs["F"])
        self._record("F", start, time.perf_counter())
        h = _Cost.apply(x + self.anchor, self.costs["I"], self._record, "I")
        w = _Cost.apply(self.weight, self.costs["W"], self._record, "W")
        return h + h.detach() * w  # W's node lies only on the weight's path


@dataclass(frozen=True)
class FixedCostRun:
    """Time pipeline steps of :class:`FixedCostStage` stages under ``schedule`` (chapter 9): each
    rank does ``unit_s`` of F, of I and of W per microbatch. The fastest of ``repeats`` steps per
    ``m`` is kept: what else runs on the machine can only add time."""

    schedule: str = "gpipe"
    n_microbatches: tuple[int, ...] = (2, 4, 8)
    unit_s: float = 0.04
    repeats: int = 2

    def __post_init__(self) -> None:
        _check_schedule(self.schedule)

    def run(self, ctx: DistContext) -> ScheduleTiming:
        v = _SCHEDULES[self.schedule][1]
        kept = []
        for m in self.n_microbatches:
            stages = [FixedCostStage(ctx.rank + k * ctx.world_size, 0.0, 0.0, 0.0).to(ctx.device)
                      for k in range(v)]
            X = torch.ones(2 * m, 16, device=ctx.device)
            schedule = _schedule(stages, self.schedule, m, ctx)
            step = partial(_pipeline_step, schedule, X, torch.zeros_like(X), ctx)
            step()  # sets the stages up (shapes, buffers) at no cost
            for stage in stages:
                stage.costs = dict.fromkeys("FIW", self.unit_s / v)
            kept.append(min(_time_steps(stages, step, self.repeats, ctx), key=lambda r: r[0]))
        return ScheduleTiming(self.schedule, ctx.world_size, self.unit_s,
                              list(self.n_microbatches), [s for s, _ in kept], [t for _, t in kept])


_KINDS = {"F": ("tab:blue", "forward"), "I": ("tab:orange", "input gradient"),
          "W": ("tab:green", "weight gradient")}


def plot_pipeline_timeline(timing: ScheduleTiming, index: int, ax):
    """A Gantt chart of step ``index`` of ``timing`` on ``ax``: one row per rank, one bar per piece
    of work labelled with its microbatch; the white gaps are the idle time (chapter 9)."""
    from matplotlib.patches import Patch

    unit = timing.unit_s
    for rank, _stage, kind, mb, a, b in timing.events[index]:
        ax.broken_barh([(a / unit, (b - a) / unit)], (rank - 0.4, 0.8),
                       facecolors=_KINDS[kind][0], edgecolor="white", linewidth=0.5)
        if (b - a) / unit > 0.3:
            ax.text((a + b) / 2 / unit, rank, f"{mb}", ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(timing.n_ranks), [f"rank {r}" for r in range(timing.n_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, timing.step_seconds[index] / unit)
    ax.set_xlabel(f"time (units of {unit * 1e3:.0f} ms: one forward of one microbatch)")
    m = timing.n_microbatches[index]
    ax.set_title(f"{timing.schedule}, {timing.n_ranks} ranks, m = {m}: bubble "
                 f"{timing.bubble_fraction[index]:.0%} (formula {timing.formula[index]:.0%}), "
                 f"all idle {timing.idle_fraction[index]:.0%}", fontsize=9)
    ax.legend(handles=[Patch(color=c, label=label) for c, label in _KINDS.values()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    return ax


def tp_plan(spec: ModelSpec, sequence_parallel: bool = False) -> dict[str, Any]:
    """``parallelize_module``'s plan for every block of ``spec.build()``: the first matmuls
    column-wise, the last row-wise (Megatron). With ``sequence_parallel`` the activations
    between blocks stay split along the sequence (reduce-scatter, then all-gather)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

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


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _check_tp(spec: ModelSpec, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    split, what = (spec.hidden, "hidden units") if spec.kind == "mlp" else (spec.heads, "heads")
    if split % tp:
        raise ValueError(f"{split} {what} do not split over {tp} tensor-parallel ranks: use a "
                         f"multiple of {tp}")
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"a sequence of {seq_len} does not split over {tp} ranks: use a multiple")


@dataclass(frozen=True)
class TensorParallelRun:
    """Train ``spec`` with every block split over the ranks (tensor parallel), counting one step's
    collectives in ``extra["comm"]``: kind -> (calls, bytes) (chapter 9)."""

    spec: ModelSpec = ModelSpec()
    batch_size: int = 4
    seq_len: int = 8
    steps: int = 2
    lr: float = 0.05
    sequence_parallel: bool = False

    def run(self, ctx: DistContext) -> TrainResult:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        _check_tp(self.spec, ctx.world_size, self.seq_len, self.sequence_parallel)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        model = self.spec.build().to(ctx.device)
        parallelize_module(model, mesh, tp_plan(self.spec, self.sequence_parallel))
        opt = _optimizer(model.parameters(), self.lr)
        losses, comm = [], {}
        for step in range(self.steps):
            X, Y = self.spec.data(self.batch_size, self.seq_len, step, device=ctx.device)
            if self.sequence_parallel:  # each rank holds its part of the sequence
                X, Y = (t.chunk(ctx.world_size, dim=1)[ctx.rank] for t in (X, Y))
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
        return TrainResult(full_cpu_state(model), losses, {"comm": comm})


@dataclass(frozen=True)
class TwoDRun:
    """FSDP2 over ``dp`` and tensor parallel over ``tp`` of ``mesh_shape = (dp, tp)``, the batch
    split over ``dp`` (chapter 9); ``extra["bytes_per_rank"]``: each rank's parameter and
    optimizer bytes. The blocks compute in ``param_dtype`` (None: fp32; fp16 scales the loss);
    ``hooks`` resume and save, e.g. :class:`d2lgpu.runtime.checkpoints.Checkpoints`."""

    spec: ModelSpec = ModelSpec()
    mesh_shape: tuple[int, int] = (2, 2)
    batch_size: int = 8
    seq_len: int = 8
    steps: int = 2
    lr: float = 0.05
    seed: int = 0
    param_dtype: torch.dtype | None = None
    hooks: Any = None

    def run(self, ctx: DistContext) -> TrainResult:
        return _train_2d(self, ctx)

    def settings(self) -> dict[str, Any]:
        """What a checkpoint of this run records and a resumed run must repeat, by name."""
        spec = self.spec
        return {"model (kind, width, hidden, depth, heads, norm)":
                [spec.kind, spec.width, spec.hidden, spec.depth, spec.heads, spec.norm],
                "global batch size": self.batch_size, "sequence length": self.seq_len,
                "learning rate": self.lr, "optimizer": "sgd, momentum 0.9", "seed": self.seed,
                "compute dtype": dtype_name(self.param_dtype)}


def _train_2d(run: TwoDRun, ctx: DistContext) -> TrainResult:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor.parallel import parallelize_module

    dp, tp = check_2d(run.spec, run.mesh_shape, ctx.world_size, run.batch_size)
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = run.spec.build(run.seed).to(ctx.device)
    # Tensor parallel first, then FSDP2 shards the DTensors it made; the blocks compute in
    # param_dtype and reduce gradients in fp32.
    parallelize_module(model, mesh["tp"], tp_plan(run.spec))
    policy = MixedPrecisionPolicy(param_dtype=run.param_dtype, reduce_dtype=torch.float32)
    for module in (*model, model):
        fully_shard(module, mesh=mesh["dp"], mp_policy=policy)
    opt = _optimizer(model.parameters(), run.lr)
    # fp16: the scaler agrees over all ranks whether any gradient overflowed.
    scaler = ShardedGradScaler(ctx.device.type, enabled=run.param_dtype == torch.float16)
    hooks, start, losses, settings = run.hooks, 0, [], run.settings()
    if hooks:
        resumed = hooks.resume(model, opt, scaler, settings, run.steps)
        start, losses = resumed.step, list(resumed.extra.get("losses", []))
    dp_rank, local = mesh["dp"].get_local_rank(), run.batch_size // dp
    rows = slice(dp_rank * local, (dp_rank + 1) * local)  # this dp group's share of a batch
    for step in range(start, run.steps):
        mark_progress(f"step {step + 1}")
        X, Y = run.spec.data(run.batch_size, run.seq_len, step, run.seed, ctx.device)
        loss = F.mse_loss(model(X[rows]).float(), Y[rows])
        if hooks:
            hooks.after_forward(step)
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
        if hooks:
            hooks.after_step(step + 1, model, opt, scaler, settings, run.steps,
                             {"losses": losses, "mesh": [dp, tp]})
    sizes: list[Any] = [None] * ctx.world_size
    optim = (v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    dist.all_gather_object(sizes, (_local_bytes(model.parameters()), _local_bytes(optim)))
    # Gathering a tensor split over both dimensions takes two all-gathers, and torch >= 2.10
    # warns about it on every rank; for one gather at the end that is fine.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return TrainResult(full_cpu_state(model), losses, {"bytes_per_rank": sizes})


def check_2d(spec: ModelSpec, mesh_shape: Sequence[int], world_size: int,
             batch_size: int) -> tuple[int, int]:
    """``(dp, tp)``, if ``spec`` trains on that mesh of ``world_size`` ranks."""
    shape = check_mesh(mesh_shape, world_size)
    if len(shape) != 2:
        raise ValueError(f"a 2-D mesh has two dimensions (dp, tp), got {shape}")
    dp, tp = shape
    _check_tp(spec, tp, 1, False)
    if batch_size % dp:
        raise ValueError(f"a batch of {batch_size} does not split over {dp} data-parallel ranks: "
                         f"use a multiple of {dp}")
    return dp, tp


def param_bytes_2d(spec: ModelSpec, dp: int, tp: int) -> int:
    """Parameter bytes on each rank of a ``(dp, tp)`` mesh, with no padding (chapter 9): a
    row-parallel bias and a norm stay whole over ``tp``."""
    split = set(tp_plan(spec))  # the names of the layers split over "tp"
    total = 0
    for name, p in spec.build().named_parameters():
        layer, kind = name.rsplit(".", 1)
        tp_split = layer in split and not (kind == "bias" and layer.endswith(("fc2", "out")))
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


def split_table(params: float | None = None, width: int | None = None, layers: int | None = None,
                tokens: int | None = None, n: int = 8, microbatches: int = 32,
                bytes_per_number: int = 2, tp: int = 4) -> list[SplitRow]:
    """Memory, bytes sent and idle time per device of each way to split training (chapter 9): the
    formulas, and given the sizes each device's GB of Adam state and GB sent a step. The 2-D
    row is ``tp``-way TP and ``n / tp``-way FSDP."""
    sizes = (params, width, layers, tokens)
    if sizes == (None,) * 4:
        return list(_SPLITS)
    if None in sizes:
        raise ValueError("give params, width, layers and tokens together, or none of them")
    if n % tp:
        raise ValueError(f"tp={tp} does not divide n={n}: use a divisor of {n}")
    b, ring, dp2 = bytes_per_number, (n - 1) / n, n // tp
    act = tokens * width * b  # one layer's output for the whole batch
    # One per row of _SPLITS: DDP, FSDP, pipeline, tensor parallel, 2-D.
    traffic = [2 * params * b * ring, 3 * params * b * ring, 2 * act, 4 * layers * 2 * act * ring,
               4 * layers * 2 * (act / dp2) * (tp - 1) / tp + 3 * params / tp * b * (dp2 - 1) / dp2]
    memory = [16 * params] + [16 * params / n] * 4
    idle = [r.idle for r in _SPLITS]
    idle[2] = f"bubble {bubble_formula(n, microbatches):.0%} (m={microbatches})"
    return [SplitRow(r.name, r.memory, r.traffic, i, m / 1e9, t / 1e9)
            for r, m, t, i in zip(_SPLITS, memory, traffic, idle, strict=True)]
