"""Chapter 7's helpers: profiler traces read and drawn, memory timelines, the roofline, the
fast path as an ablation, and torch.compile's graph breaks and modes."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import itertools
import json
import logging
import math
import os
import pickle
import statistics
import tempfile
import time
from collections import namedtuple
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from d2lgpu import models, precision
from d2lgpu.chips import peak_format
from d2lgpu.data import DeviceLoader, fashion_mnist_tensors, load_data_fashion_mnist
from d2lgpu.fast import (
    TECHNIQUES,
    Techniques,
    fast_epoch,
    make_sgd,
    technique_skip_reason,
)
from d2lgpu.runtime.config import small_data, smoke_mode, workload
from d2lgpu.runtime.gpus import as_device, cuda_usable
from d2lgpu.timing import format_table, gbps, tflops, time_fn, timed_calls
from d2lgpu.training import History

__all__ = [
    "ABLATION_LABELS", "COUNT_UNITS", "AblationRow", "AblationStep", "Roofline", "RooflinePoint",
    "SlowStorage", "TraceEvent", "TraceSummary", "ablation_data", "ablation_numbers",
    "ablation_plan", "ablation_settings", "compare_compile_modes", "count_effects",
    "count_technique_effect", "explain_graph_breaks", "fresh_compile", "idle_gaps",
    "measure_roofline", "measure_stream_bandwidth",
    "memory_timeline_from_snapshot", "memory_timeline_from_trace", "merge_intervals", "mfu_note",
    "op_table", "paired_multiply_add_ratio", "plot_memory_timeline", "plot_roofline",
    "plot_timeline", "previous_ran", "profiler_activities", "read_trace", "roofline_points",
    "run_ablation", "runs_dir", "speed_ratios", "summarize_trace", "timeline_lanes",
]


def runs_dir(name: str) -> Path:
    """A directory for traces and snapshots, created if needed (chapter 7): ``runs/<name>`` in
    the course's checkout (git ignores ``/runs/``), else under the system's temporary one."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        raise ValueError(f"name must be one plain directory name such as 'ch7', got {name!r}")
    root = Path(__file__).resolve().parent.parent
    gitignore = root / ".gitignore"
    if gitignore.is_file() and "/runs/" in gitignore.read_text(encoding="utf-8").split():
        base = root / "runs"
    else:  # installed with pip, e.g. on Colab
        base = Path(tempfile.gettempdir()) / "d2lgpu-runs"
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _quiet_kineto() -> None:
    """Without a GPU, Kineto logs that it found none, and then every profiler start and stop."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def profiler_activities(device: torch.device | str) -> list[torch.profiler.ProfilerActivity]:
    """What ``torch.profiler.profile`` should record for work on ``device``: host operators,
    and on a GPU its kernels and copies too (chapter 7)."""
    device = as_device(device)
    if device.type == "cpu":
        _quiet_kineto()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def op_table(prof: torch.profiler.profile, top: int = 10) -> str:
    """The ``top`` operators of a finished profile by self time (on the device, if any), in
    lines of at most 100 characters: ``key_averages().table()``'s are about 200 (chapter 7)."""
    averages = list(prof.key_averages())
    if not averages:
        raise ValueError("the profile recorded no operators: was anything run inside it?")
    on_device = any(avg.self_device_time_total > 0 for avg in averages)
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    columns = {"self CPU ms": "self_cpu_time_total", "CPU total ms": "cpu_time_total"}
    if on_device:
        columns["self GPU ms"] = key
    rows = []
    for avg in sorted(averages, key=lambda avg: getattr(avg, key), reverse=True)[:top]:
        name = avg.key if len(avg.key) <= 44 else avg.key[:41] + "..."
        times = [f"{getattr(avg, attr) / 1e3:.2f}" for attr in columns.values()]
        rows.append([name, str(avg.count), *times])
    return format_table(["operator", "calls", *columns], rows)


@dataclass(frozen=True)
class TraceEvent:
    """One event of a Chrome trace: ``category`` is its ``cat`` (``cpu_op``, ``kernel``, ...),
    times are microseconds, ``thread`` the host thread or CUDA stream."""

    name: str
    category: str
    start_us: float
    duration_us: float
    thread: int
    args: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


def read_trace(path: str | Path) -> list[TraceEvent]:
    """The duration and instant events of a Chrome trace (``.json`` or ``.json.gz``), sorted by
    start (chapter 7)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    fix = "write it with prof.export_chrome_trace(path)"
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            raw = json.load(f)["traceEvents"]
        events = []
        for e in raw:
            if e.get("ph") not in ("X", "i") or "ts" not in e:
                continue  # metadata, flow arrows, counters
            tid = str(e.get("tid", 0))
            events.append(TraceEvent(
                str(e.get("name", "")), str(e.get("cat", "")), float(e["ts"]),
                float(e.get("dur", 0.0)) if e["ph"] == "X" else 0.0,
                int(tid) if tid.lstrip("-").isdigit() else 0, e.get("args") or {}))
    except FileNotFoundError:
        raise FileNotFoundError(f"no trace at {path}: {fix} first") from None
    except Exception as e:  # unreadable, not gzip, not JSON, not a trace's events
        raise ValueError(f"{path} is not a Chrome trace (JSON with a 'traceEvents' list, "
                         f"gzipped if named .gz) [{type(e).__name__}: {e}]: {fix}") from None
    events.sort(key=lambda ev: (ev.start_us, -ev.duration_us))
    return events


def _train_steps(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    steps = [e for e in events if e.name == "train_step" and e.duration_us > 0]
    if not steps:
        raise ValueError("the trace has no 'train_step' ranges: profile a d2lgpu.train_fast "
                         "call, or wrap your steps in torch.profiler.record_function('train_step')")
    return steps


def _syncs_in_steps(events: Sequence[TraceEvent], steps: Sequence[TraceEvent]) -> list[TraceEvent]:
    # .item(), float(t) and `if t:` run aten::item, which waits for the device
    return [e for e in events if e.name == "aten::item" and any(
        s.thread == e.thread and s.start_us <= e.start_us and e.end_us <= s.end_us
        for s in steps)]


def _fetches(events: Sequence[TraceEvent]) -> list[TraceEvent]:
    # torch wraps every DataLoader fetch in a range named enumerate(DataLoader)#...
    return [e for e in events if e.name.startswith("enumerate(DataLoader)") and e.duration_us > 0]


@dataclass(frozen=True)
class TraceSummary:
    """A profiled training loop's steps, the ``.item()`` calls inside them and the DataLoader
    fetches that fed them: how many, and their total milliseconds."""

    train_steps: int
    item_calls: int
    dataloader_fetches: int
    step_ms: float
    dataloader_ms: float
    sync_ms: float

    @property
    def item_calls_per_step(self) -> float:
        return self.item_calls / self.train_steps

    @property
    def dataloader_share(self) -> float:
        total = self.step_ms + self.dataloader_ms
        return self.dataloader_ms / total if total > 0 else 0.0


def summarize_trace(events: Sequence[TraceEvent]) -> TraceSummary:
    """Count the steps, syncs and DataLoader fetches of a training loop in its trace, from
    the ``train_step`` ranges :func:`d2lgpu.train_fast` marks (chapter 7)."""
    steps = _train_steps(events)
    syncs = _syncs_in_steps(events, steps)
    last_end = max(s.end_us for s in steps)
    fetches = [e for e in _fetches(events) if e.end_us <= last_end]
    ms = [sum(e.duration_us for e in part) / 1e3 for part in (steps, fetches, syncs)]
    return TraceSummary(len(steps), len(syncs), len(fetches), *ms)


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching ``(start, end)`` intervals merged, sorted by start."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def idle_gaps(
    busy: Iterable[tuple[float, float]], start: float, end: float, min_gap: float = 0.0
) -> list[tuple[float, float]]:
    """The parts of ``[start, end]`` that no ``busy`` interval covers, longer than ``min_gap``."""
    gaps, cursor = [], start
    for a, b in merge_intervals(busy):
        if a > cursor and min(a, end) - cursor > min_gap:
            gaps.append((cursor, min(a, end)))
        cursor = max(cursor, b)
        if cursor >= end:
            break
    if end - cursor > min_gap:
        gaps.append((cursor, end))
    return gaps


def timeline_lanes(events: Sequence[TraceEvent]) -> dict[str, list[tuple[float, float]]]:
    """A trace as lanes of merged ``(start_us, end_us)`` intervals (chapter 7): the steps, the
    DataLoader, ``.item()``, on a GPU host ops and kernels, and ``idle``: gaps over 1% of the
    steps' span in the lane that does the model's work (the kernels on a GPU, else the steps)."""
    steps = _train_steps(events)
    lanes = {
        "train steps": [(s.start_us, s.end_us) for s in steps],
        "DataLoader": merge_intervals((e.start_us, e.end_us) for e in _fetches(events)),
        ".item() in steps": merge_intervals(
            (e.start_us, e.end_us) for e in _syncs_in_steps(events, steps) if e.duration_us > 0),
    }
    kernels = merge_intervals((e.start_us, e.end_us) for e in events
                              if e.category in ("kernel", "gpu_memcpy", "gpu_memset"))
    if kernels:
        lanes["host ops"] = merge_intervals(
            (e.start_us, e.end_us) for e in events
            if e.category == "cpu_op" and e.duration_us > 0 and e.thread == steps[0].thread)
        lanes["GPU kernels"] = kernels
    start, end = steps[0].start_us, max(s.end_us for s in steps)
    lanes["idle"] = idle_gaps(kernels or lanes["train steps"], start, end, 0.01 * (end - start))
    return lanes


_LANE_COLOURS = {
    "train steps": "tab:blue", "DataLoader": "tab:orange", "host ops": "tab:green",
    ".item() in steps": "tab:red", "GPU kernels": "tab:purple",
}


def plot_timeline(events: Sequence[TraceEvent], ax=None, *, title: str | None = None):
    """Draw a trace's training steps as the lanes of :func:`timeline_lanes`, idle gaps hatched,
    in ms from the first step (chapter 7)."""
    import matplotlib.pyplot as plt

    lanes = timeline_lanes(events)
    origin = lanes["train steps"][0][0]
    fetched = [e.start_us for e in _fetches(events) if e.end_us <= origin]
    window = (max(fetched) if fetched else origin), max(b for _, b in lanes["train steps"])
    names = [name for name in lanes if name != "idle"]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 * len(names) + 1.3))

    def clipped(spans):
        return [((max(a, window[0]) - origin) / 1e3, (min(b, window[1]) - max(a, window[0])) / 1e3)
                for a, b in spans if b > window[0] and a < window[1]]

    for row, name in enumerate(names):
        ax.broken_barh(clipped(lanes[name]), (row - 0.35, 0.7), color=_LANE_COLOURS[name])
    worker_row = names.index("GPU kernels" if "GPU kernels" in names else "train steps")
    idle = clipped(lanes["idle"])
    if idle:
        ax.broken_barh(idle, (worker_row - 0.45, 0.9), facecolor="none", edgecolor="red",
                       hatch="///", linewidth=0.5, label="idle gaps")
        ax.legend(loc="upper right", fontsize="small")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim((window[0] - origin) / 1e3, (window[1] - origin) / 1e3)
    ax.set_xlabel("time (ms) from the first training step")
    ax.set_title(title or "")
    ax.grid(True, axis="x", alpha=0.3)
    return ax


def memory_timeline_from_trace(
    events: Sequence[TraceEvent], device: torch.device | str = "cpu"
) -> list[tuple[float, int]]:
    """``(time_us, bytes allocated)`` after every allocation and free on ``device``, from a
    trace profiled with ``profile_memory=True`` (chapter 7)."""
    device = as_device(device)
    code = {"cpu": 0, "cuda": 1}.get(device.type)
    timeline = [
        (e.start_us, int(e.args["Total Allocated"])) for e in events
        if e.name == "[memory]" and "Total Allocated" in e.args
        and int(e.args.get("Device Type", 0)) == code
        and (device.index is None or int(e.args.get("Device Id", -1)) in (device.index, -1))
    ]
    if not timeline:
        raise ValueError(f"the trace has no memory events for {device}: profile with "
                         "profile_memory=True")
    return timeline


def memory_timeline_from_snapshot(
    snapshot: Mapping[str, Any] | str | Path, device_index: int = 0
) -> list[tuple[float, int]]:
    """``(time, bytes allocated)`` after every allocation and free in a CUDA memory snapshot or
    the pickle ``_dump_snapshot`` wrote (chapter 7). What was allocated before the history began
    is what the segments hold at the end less what the history added."""
    fix = ("a CUDA memory snapshot is the pickle that torch.cuda.memory._dump_snapshot(path) "
           "writes after torch.cuda.memory._record_memory_history()")
    if not isinstance(snapshot, Mapping):
        path = Path(snapshot)
        try:
            with open(path, "rb") as f:
                snapshot = pickle.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no memory snapshot at {path}: {fix}") from None
        except Exception as err:  # a directory, or a file that does not unpickle
            raise ValueError(f"{path} is not a memory snapshot ({type(err).__name__}: {err}); "
                             f"{fix}") from None
        if not isinstance(snapshot, Mapping):
            raise ValueError(f"{path} holds a pickled {type(snapshot).__name__}, not a memory "
                             f"snapshot; {fix}")
    traces = snapshot.get("device_traces") or []
    if not 0 <= device_index < len(traces) or not traces[device_index]:
        raise ValueError(f"the snapshot has no allocation history for device index "
                         f"{device_index} of {len(traces)}: {fix}, around the work to see")
    signs = {"alloc": 1, "free_completed": -1}
    changes = [(float(entry.get("time_us", i)), signs[entry["action"]] * int(entry["size"]))
               for i, entry in enumerate(traces[device_index]) if entry.get("action") in signs]
    allocated_at_end = sum(block["size"] for segment in snapshot.get("segments", [])
                           if segment.get("device", device_index) == device_index
                           for block in segment.get("blocks", [])
                           if block.get("state") == "active_allocated")
    level = allocated_at_end - sum(change for _, change in changes)
    timeline = []
    for t, change in changes:
        level += change
        timeline.append((t, level))
    return timeline


def plot_memory_timeline(timeline: Sequence[tuple[float, int]], ax=None, *,
                         spans: Sequence[tuple[float, float, str]] = (), title: str | None = None):
    """Draw allocated MiB over time (ms) as a step line, shading the ``(start, end, label)``
    ``spans``, e.g. the training steps (chapter 7)."""
    import matplotlib.pyplot as plt

    origin = timeline[0][0]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2))
    ys = [b / 2**20 for _, b in timeline]
    ax.step([(t - origin) / 1e3 for t, _ in timeline], ys, where="post", linewidth=1)
    for i, (a, b, label) in enumerate(spans):
        ax.axvspan((a - origin) / 1e3, (b - origin) / 1e3, alpha=0.12,
                   color="tab:orange" if i % 2 else "tab:green")
        ax.text((a - origin) / 1e3, max(ys) * 1.02, label, fontsize="x-small")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("allocated (MiB)")
    ax.set_ylim(0, max(ys) * 1.12 + 1e-9)
    ax.set_title(title or "")
    ax.grid(True, alpha=0.3)
    return ax


@dataclass(frozen=True)
class RooflinePoint:
    """One operation placed on a roofline: its FLOPs, the bytes it moves, its time (chapter 7)."""

    name: str
    flops: float
    nbytes: float
    seconds: float

    def __post_init__(self) -> None:
        if not (self.flops >= 0 and self.nbytes > 0 and self.seconds > 0):
            raise ValueError(f"a RooflinePoint needs flops >= 0, nbytes > 0, seconds > 0: {self}")

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved to or from memory."""
        return self.flops / self.nbytes

    @property
    def achieved_tflops(self) -> float:
        return tflops(self.flops, self.seconds)

    @property
    def achieved_gbps(self) -> float:
        return gbps(self.nbytes, self.seconds)


@dataclass(frozen=True)
class Roofline:
    """The two ceilings of a device, compute (TFLOP/s) and memory bandwidth (GB/s): an
    operation of intensity ``I`` reaches at best ``min(peak, I * bandwidth)`` (chapter 7)."""

    peak_tflops: float
    bandwidth_gbps: float
    compute_label: str = "matmul"
    memory_label: str = "copy"
    bandwidths: Mapping[str, float] = field(default_factory=dict, compare=False)  # every roof

    def __post_init__(self) -> None:
        if not (0 < self.peak_tflops < math.inf and 0 < self.bandwidth_gbps < math.inf):
            raise ValueError(f"peak_tflops and bandwidth_gbps must be positive numbers: {self}")

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the two roofs meet."""
        return self.peak_tflops * 1e12 / (self.bandwidth_gbps * 1e9)

    def attainable_tflops(self, intensity: float) -> float:
        return min(self.peak_tflops, intensity * self.bandwidth_gbps / 1e3)

    def regime(self, point: RooflinePoint) -> str:
        """"overhead-bound" below a tenth of its roof (neither memory nor arithmetic is what
        it waits for), else "memory-bound" left of the ridge, "compute-bound" right of it."""
        if point.achieved_tflops < 0.1 * self.attainable_tflops(point.intensity):
            return "overhead-bound"
        return "memory-bound" if point.intensity < self.ridge else "compute-bound"


def _best_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int = 1,
                  repeats: int = 5) -> float:
    """The best of ``repeats`` timings of ``fn()`` after ``warmup`` calls: other work only ever
    slows a run down. On a GPU from CUDA events on ``device``'s stream, the GPU's own clock."""
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        return timed_calls(fn, device, repeats).min
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
    return min(times)


def _operands(device: torch.device, numel: int) -> tuple[torch.Tensor, ...]:
    a = torch.randn(numel, device=device)
    return a, torch.randn(numel, device=device), torch.empty_like(a)


def measure_stream_bandwidth(device: torch.device | str, numel: int, *, repeats: int = 5) -> float:
    """GB/s of an out-of-place add of two ``numel``-float tensors, 12 bytes an element: it
    writes as other elementwise ops do, where a CPU's copy may not (chapter 7)."""
    device = as_device(device)
    a, b, out = _operands(device, numel)
    seconds = _best_seconds(lambda: torch.add(a, b, out=out), device, repeats=repeats)
    return gbps(12 * numel, seconds)


def paired_multiply_add_ratio(
    device: torch.device | str, numel: int, *, repeats: int = 15
) -> float:
    """A multiply's GB/s over an add's on ``numel`` floats: the median over ``repeats``
    back-to-back pairs, so that a busy spell slows both of a pair alike (chapter 7)."""
    device = as_device(device)
    a, b, out = _operands(device, numel)
    ratios = []
    for _ in range(repeats):
        add = _best_seconds(lambda: torch.add(a, b, out=out), device, repeats=1)
        mul = _best_seconds(lambda: torch.mul(a, b, out=out), device, repeats=1)
        ratios.append(add / mul)
    return statistics.median(ratios)


def measure_roofline(
    device: torch.device | str, matmul_n: int, *, bandwidths: Mapping[str, float],
    repeats: int = 5,
) -> tuple[Roofline, RooflinePoint]:
    """The device's roofline and its matmul as a point (chapter 7): the compute roof is the
    best of ``repeats`` ``matmul_n``-square matmuls in the "auto" format (else fp32), the memory
    roof the highest of ``bandwidths`` (GB/s by kernel, e.g. a copy's and an add's)."""
    device = as_device(device)
    dtype = precision.precision_policy(device, "auto").dtype or torch.float32
    a, b = (torch.randn(matmul_n, matmul_n, device=device).to(dtype) for _ in range(2))
    seconds = _best_seconds(lambda: a @ b, device, repeats=repeats)
    flops = 2 * matmul_n**3
    dtype_name = str(dtype).replace("torch.", "")
    memory_label = max(bandwidths, key=bandwidths.__getitem__)
    roof = Roofline(tflops(flops, seconds), bandwidths[memory_label],
                    f"best {dtype_name} matmul", memory_label, dict(bandwidths))
    nbytes = 3 * matmul_n * matmul_n * a.element_size()
    return roof, RooflinePoint(f"matmul {matmul_n}x{matmul_n} {dtype_name}", flops, nbytes, seconds)


def roofline_points(
    device: torch.device | str, *, elementwise_numel: int, tiny_numel: int = 8,
    tiny_repeats: int = 1000, repeats: int = 5,
) -> list[RooflinePoint]:
    """Two fp32 multiplications (1 FLOP per 12 bytes) as points, the best of ``repeats`` runs:
    a large one, and a tiny one called ``tiny_repeats`` times (chapter 7)."""
    device = as_device(device)
    points = []
    for name, numel, calls in (
        (f"multiply {elementwise_numel:,} floats", elementwise_numel, 1),
        (f"multiply {tiny_numel} floats x {tiny_repeats}", tiny_numel, tiny_repeats),
    ):
        a, b, out = _operands(device, numel)

        def run(a=a, b=b, out=out, calls=calls):
            for _ in range(calls):
                torch.mul(a, b, out=out)

        seconds = _best_seconds(run, device, repeats=repeats)
        points.append(RooflinePoint(name, numel * calls, 12 * numel * calls, seconds))
    return points


def plot_roofline(roofline: Roofline, points: Sequence[RooflinePoint], ax=None, *,
                  title: str | None = None):
    """Draw the roofline (log-log) with ``points`` on it, labelled with their regime
    (chapter 7)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    scale, unit = (1e3, "GFLOP/s") if roofline.peak_tflops < 1 else (1.0, "TFLOP/s")
    intensities = [p.intensity for p in points] + [roofline.ridge]
    lo, hi = min(intensities) / 8, max(intensities) * 8
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [roofline.attainable_tflops(x) * scale for x in xs], color="black")
    ax.axvline(roofline.ridge, color="grey", linestyle=":", linewidth=1)
    peak = roofline.peak_tflops * scale
    ax.text(hi, peak * 1.25, f"{roofline.compute_label}: {peak:.3g} {unit}",
            fontsize="small", ha="right")
    ax.text(lo * 1.5, roofline.attainable_tflops(lo * 1.5) * scale * 1.8,
            f"{roofline.memory_label}: {roofline.bandwidth_gbps:.3g} GB/s", fontsize="small",
            rotation=22)
    markers = {"compute-bound": "o", "memory-bound": "s", "overhead-bound": "v"}
    achieved = [p.achieved_tflops * scale for p in points]
    for p, y in zip(points, achieved, strict=True):
        regime = roofline.regime(p)
        ax.scatter([p.intensity], [y], marker=markers[regime], s=60, zorder=3)
        ax.annotate(f"{p.name}\n({regime})", (p.intensity, y), textcoords="offset points",
                    xytext=(7, -4), fontsize="small", va="top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"arithmetic intensity (FLOP per byte); ridge at {roofline.ridge:.3g}")
    ax.set_ylabel(unit)
    floor = min(achieved + [roofline.attainable_tflops(lo) * scale])
    ax.set_ylim(floor / 5, max(achieved + [peak]) * 4)
    ax.set_title(title or "")
    ax.grid(True, which="both", alpha=0.2)
    return ax


#: The row labels of the ablation, in order: the baseline, then one per technique.
ABLATION_LABELS: dict[str | None, str] = {
    None: "d2l-style baseline",
    "device_data": "+ data on the device",
    "no_sync": "+ no per-step sync",
    "precision": "+ mixed precision",
    "channels_last": "+ channels-last",
    "fused_optimizer": "+ fused optimizer",
    "compile": "+ torch.compile",
    "cuda_graphs": "+ CUDA graphs",
}


@dataclass(frozen=True)
class AblationStep:
    """One row of the ablation: the techniques on so far, or why this row's technique is
    skipped (then ``techniques`` are the previous row's) (chapter 7)."""

    technique: str | None  # None for the baseline
    techniques: Techniques
    skip_reason: str | None = None

    @property
    def label(self) -> str:
        return ABLATION_LABELS[self.technique]


def ablation_plan(
    device: torch.device | str, skip: Mapping[str, str] | None = None
) -> list[AblationStep]:
    """The d2l-style baseline, then one technique of :data:`d2lgpu.fast.TECHNIQUES` added per
    row (chapter 7). A technique :func:`d2lgpu.technique_skip_reason` leaves out on
    ``device``, or that ``skip`` maps to a reason, is a skipped row and stays off after it."""
    device = as_device(device)
    skip = dict(skip or {})
    if set(skip) - set(TECHNIQUES):
        raise ValueError(f"skip names unknown techniques {sorted(set(skip) - set(TECHNIQUES))}; "
                         f"see {TECHNIQUES}")
    current = Techniques.d2l_style()
    plan = [AblationStep(None, current)]
    for name in TECHNIQUES:
        reason = skip.get(name) or technique_skip_reason(name, device)
        if reason is None:
            on = "auto" if name == "precision" else True
            current = dataclasses.replace(current, **{name: on})
        plan.append(AblationStep(name, current, reason))
    return plan


@dataclass(frozen=True)
class AblationRow:
    """A measured (or skipped) row of the ablation (chapter 7). ``round_speeds``: per run, the
    images/s of its epochs after the first; ``history`` is the first run's."""

    step: AblationStep
    history: History | None = None
    round_speeds: tuple[tuple[float, ...], ...] = ()

    @property
    def label(self) -> str:
        return self.step.label

    @property
    def ran(self) -> bool:
        return self.history is not None

    @property
    def images_per_second(self) -> float | None:
        """The median images/s of all the row's epochs after the first."""
        return statistics.median(v for run in self.round_speeds for v in run) if self.ran else None

    @property
    def test_acc(self) -> float | None:
        return self.history.test_acc[-1] if self.ran else None

    @property
    def first_epoch_seconds(self) -> float | None:
        return self.history.epoch_seconds[0] if self.ran else None


def speed_ratios(row: AblationRow, before: AblationRow) -> tuple[float, ...]:
    """``row``'s speed over ``before``'s, epoch k of run r over epoch k of run r: the two ran
    minutes apart at most, so a busy spell that slows both cancels in the ratio."""
    return tuple(mine / theirs
                 for run, run_before in zip(row.round_speeds, before.round_speeds, strict=False)
                 for mine, theirs in zip(run, run_before, strict=False))


def previous_ran(rows: Sequence[AblationRow], row: AblationRow) -> AblationRow:
    """The row that ran last before ``row`` (``row`` itself for the first that ran): the one
    ``row`` adds its technique to (chapter 7)."""
    before = [r for r in rows[: list(rows).index(row)] if r.ran]
    return before[-1] if before else row


def mfu_note(device: torch.device | str, peak: float | None) -> str:
    """Why MFU is or is not reported on ``device``, in one line (chapter 7)."""
    device = as_device(device)
    if peak is not None:
        dtype = peak_format(device) if device.type == "cuda" else None
        return (f"MFU: counted matmul/conv FLOPs over the {peak:g} TFLOP/s "
                f"{dtype + ' ' if dtype else ''}data-sheet peak")
    if device.type == "cpu":
        return "MFU n/a: a CPU has no data-sheet Tensor Core peak to divide by"
    return f"MFU n/a: no data-sheet peak listed for {torch.cuda.get_device_name(device)}"


@dataclass(frozen=True)
class AblationSettings:
    """How big the ablation of chapter 7 is: ``model`` names a d2lgpu model function, a size
    of None is the whole split, ``repeats`` the runs per row, interleaved."""

    model: str
    batch_size: int
    num_epochs: int
    lr: float
    train_size: int | None
    test_size: int | None
    skip: Mapping[str, str] = field(default_factory=dict)  # technique -> reason
    repeats: int = 1

    def make_model(self) -> nn.Module:
        return getattr(models, self.model)()

    def describe(self) -> str:
        examples = "quick subset" if self.train_size is None and small_data() else (
            "all" if self.train_size is None else f"{self.train_size:,}")
        runs = f", {self.repeats} runs per row" if self.repeats > 1 else ""
        return (f"{self.model}, {examples} training images, batch {self.batch_size}, "
                f"{self.num_epochs} epochs, lr {self.lr}{runs}")


def ablation_settings(chosen: str | None = None) -> AblationSettings:
    """The ablation's size for a workload (None: :func:`d2lgpu.workload`) (chapter 7): ``full``
    ResNet-18 on 15,000 images (about 24 min on a T4), ``cpu`` the small CNN on 3,200, both
    twice, 3 epochs; ``quick`` the small CNN on the quick subset, without compile or fused SGD."""
    chosen = workload() if chosen is None else chosen
    if chosen == "full" and smoke_mode():  # full mode's rows, four small batches
        # On a CPU the small CNN: ResNet-18 on two cores made chapter 7's smoke run 190 s.
        model = "resnet18" if cuda_usable() else "small_cnn"
        return AblationSettings(model, 8, 2, 0.1, 32, 16)
    if chosen == "full":
        return AblationSettings("resnet18", 256, 3, 0.1, 15_000, 10_000, repeats=2)
    if chosen == "cpu":
        return AblationSettings("small_cnn", 64, 3, 0.1, 3200, 2000, repeats=2)
    if chosen == "quick":
        return AblationSettings("small_cnn", 32, 2, 0.1, None, None, {
            "compile": "quick mode: compiling takes tens of seconds or more on a CPU",
            "fused_optimizer": "quick mode: one row fewer; section 5.5 checks fused SGD"})
    raise ValueError(f"chosen must be 'quick', 'cpu', 'full' or None, got {chosen!r}")


def ablation_data(
    batch_size: int, device: torch.device | str, *, train_size: int | None = None,
    test_size: int | None = None, quick: bool | None = None,
) -> tuple[tuple[Iterable, Iterable], tuple[DeviceLoader, DeviceLoader]]:
    """The first ``train_size``/``test_size`` Fashion-MNIST examples (None: all) as DataLoaders
    and as :class:`d2lgpu.DeviceLoader` s on ``device``, for chapter 7's ablation,
    from the quick subsets when ``quick`` (None: in quick and smoke mode)."""
    loaders, resident = [], []
    for loader, size, train in zip(load_data_fashion_mnist(batch_size, quick=quick),
                                   (train_size, test_size), (True, False), strict=True):
        if size is not None:
            subset = torch.utils.data.Subset(loader.dataset, range(min(size, len(loader.dataset))))
            loader = torch.utils.data.DataLoader(
                subset, batch_size, shuffle=train, num_workers=loader.num_workers,
                pin_memory=loader.pin_memory, persistent_workers=loader.num_workers > 0)
        loaders.append(loader)
        images, labels = fashion_mnist_tensors(train=train, quick=quick)
        resident.append(DeviceLoader(images[:size], labels[:size],
                                     batch_size if train else max(batch_size, 1024),
                                     device=device, shuffle=train))
    return (loaders[0], loaders[1]), (resident[0], resident[1])


#: The techniques whose gain on a GPU comes from what a CPU lacks (host reads that stall a
#: GPU's queue, Tensor Cores, kernel launches): on a CPU their effect is counted as well.
COUNTED_ON_CPU = ("no_sync", "precision", "fused_optimizer")
COUNT_UNITS = {
    "no_sync": ".item() reads a training step",
    "precision": "MiB autograd saves for backward a step",
    "fused_optimizer": "ATen operators an optimizer.step()",
}


def _profiled_events(fn: Callable[[], Any]) -> list:
    _quiet_kineto()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof.events()


def count_technique_effect(
    technique: str, make_model: Callable[[], nn.Module],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], lr: float, device: torch.device,
    before: Techniques,
) -> tuple[float, float]:
    """What switching ``technique`` on (on top of ``before``) changes, counted without it and
    with it on the first 4 of ``batches``, in ``COUNT_UNITS[technique]`` (chapter 7)."""
    batches = list(itertools.islice(iter(batches), 4))
    if technique == "no_sync":  # epochs of 2 and 4 steps: what an epoch's end reads cancels
        reads = {}
        for no_sync, n in itertools.product((False, True), (2, 4)):
            switches = dataclasses.replace(before, no_sync=no_sync)
            policy = precision.precision_policy(device, switches.precision)
            net = make_model().to(device)
            events = _profiled_events(functools.partial(
                fast_epoch, net, batches[:n], torch.optim.SGD(net.parameters(), lr=lr), device,
                policy, policy.make_scaler(), switches, tqdm(disable=True)))
            reads[no_sync, n] = sum(e.name == "aten::_local_scalar_dense" for e in events)
        return (reads[False, 4] - reads[False, 2]) / 2, (reads[True, 4] - reads[True, 2]) / 2
    X, y = batches[0]
    if technique == "precision":
        saved = []
        for word in (before.precision, "auto"):
            torch.manual_seed(0)
            saved.append(precision.saved_activation_bytes(
                make_model().to(device), X, y, precision.precision_policy(device, word)))
        return saved[0] / 2**20, saved[1] / 2**20
    ops = []  # fused_optimizer: torch's default SGD, then make_sgd's
    for make in (lambda ps: torch.optim.SGD(ps, lr=lr), lambda ps: make_sgd(ps, lr, device)):
        torch.manual_seed(0)
        net = make_model().to(device)
        optimizer = make(net.parameters())
        nn.functional.cross_entropy(net(X), y).backward()
        optimizer.step()  # the first step creates state; count the second
        ops.append(sum(e.name.startswith("aten::") and not (
            e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))
            for e in _profiled_events(optimizer.step)))
    return float(ops[0]), float(ops[1])


def run_ablation(
    plan: Sequence[AblationStep], train_row: Callable[[AblationStep], History], *,
    repeats: int = 1, on_run: Callable[[AblationStep], None] | None = None,
) -> list[AblationRow]:
    """``train_row(step)`` for every row of ``plan`` not skipped, ``repeats`` rounds: forwards,
    then backwards, and so on, so that a busy spell favours no row (chapter 7). Dynamo is
    reset before every compiled run; ``on_run`` gets the step of every run."""
    plan = list(plan)
    histories: list[list[History]] = [[] for _ in plan]
    for round_ in range(repeats):
        for i in range(len(plan)) if round_ % 2 == 0 else reversed(range(len(plan))):
            step = plan[i]
            if step.skip_reason is None:
                if step.techniques.compile or step.techniques.cuda_graphs:
                    # every run compiles anew: past dynamo's recompile limit, fullgraph raises
                    torch._dynamo.reset()
                histories[i].append(train_row(step))
            if on_run is not None:
                on_run(step)
    return [AblationRow(step, runs[0], tuple(tuple(h.examples_per_second[1:]
                                                   or h.examples_per_second) for h in runs))
            if runs else AblationRow(step) for step, runs in zip(plan, histories, strict=True)]


def count_effects(
    plan: Sequence[AblationStep], make_model: Callable[[], nn.Module],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]], lr: float, device: torch.device | str,
) -> dict[str, tuple[float, float]]:
    """``{technique: (without, with)}`` for the rows of ``plan`` that run a technique of
    :data:`COUNTED_ON_CPU`: :func:`count_technique_effect` on top of the row before that runs,
    in ``COUNT_UNITS[technique]`` (chapter 7)."""
    device = as_device(device)
    counts, before = {}, None
    for step in plan:
        if step.skip_reason is None:
            if step.technique in COUNTED_ON_CPU:
                counts[step.technique] = count_technique_effect(
                    step.technique, make_model, batches, lr, device, before)
            before = step.techniques
    return counts


#: One row of the ablation in numbers that agree (chapter 7): ``x_prev``, the median of the
#: paired ratios against the row that ran before, ``low`` and ``high`` their range,
#: ``images_per_second`` the baseline's median times every ``x_prev`` down to this row.
AblationNumbers = namedtuple("AblationNumbers", "x_prev low high images_per_second x_base mfu")


def ablation_numbers(
    rows: Sequence[AblationRow], flops_per_example: float | None = None, peak: float | None = None
) -> list[AblationNumbers | None]:
    """:class:`AblationNumbers` for every row of :func:`run_ablation`'s result, None for a
    skipped row; the first row that ran is the baseline (chapter 7). MFU needs the FLOPs per
    training example and the device's ``peak`` TFLOP/s (else None)."""
    numbers: list[AblationNumbers | None] = []
    base_speed = speed = None
    for r in rows:
        if not r.ran:
            numbers.append(None)
            continue
        before = previous_ran(rows, r)
        if before is r:
            ratios = (1.0,)
            base_speed = speed = r.images_per_second
        else:
            ratios = speed_ratios(r, before)
            speed *= statistics.median(ratios)
        mfu = None if None in (flops_per_example, peak) else (
            speed * flops_per_example / (peak * 1e12))
        numbers.append(AblationNumbers(statistics.median(ratios), min(ratios), max(ratios),
                                       speed, speed / base_speed, mfu))
    return numbers


class SlowStorage(torch.utils.data.Dataset):
    """``dataset`` whose every item arrives ``latency`` seconds late, as from a network share
    (chapter 7). In the package so that workers started with ``spawn`` can import it."""

    def __init__(self, dataset: torch.utils.data.Dataset, latency: float) -> None:
        self.dataset = dataset
        self.latency = latency

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        time.sleep(self.latency)
        return self.dataset[index]


#: Where ``torch.compile`` had to end a graph: the line, dynamo's reason, its explanation.
GraphBreak = namedtuple("GraphBreak", "code reason explanation")


@dataclass(frozen=True)
class GraphBreakReport:
    """How many graphs a function became, how many breaks split it, and each break."""

    graph_count: int
    break_count: int
    breaks: tuple[GraphBreak, ...]

    def describe(self) -> str:
        """The report as lines of at most 100 characters."""
        lines = [f"{self.graph_count} graph(s), {self.break_count} graph break(s)"]
        for i, b in enumerate(self.breaks, 1):
            lines += [f"break {i} at: {b.code}", f"    reason: {b.reason}"]
            if b.explanation:
                lines.append(f"    {b.explanation}")
        return "\n".join(line if len(line) <= 100 else line[:97] + "..." for line in lines)


def explain_graph_breaks(fn: Callable, *args, **kwargs) -> GraphBreakReport:
    """Trace ``fn(*args, **kwargs)`` with ``torch._dynamo.explain`` (no code generation) and
    report its graphs and graph breaks (chapter 7)."""
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)  # dynamo logs every break with a stack; the report says it
    try:
        explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    finally:
        logger.setLevel(level)
    breaks = []
    for item in explanation.break_reasons:
        lines = [line.strip() for line in str(item.reason).splitlines() if line.strip()]
        why = next((line for line in lines if line.startswith("Explanation:")), "")
        code = (item.user_stack[-1].line or "").strip() if item.user_stack else ""
        breaks.append(GraphBreak(code or "?", lines[0] if lines else "(no reason given)",
                                 why.removeprefix("Explanation:").strip()))
    return GraphBreakReport(explanation.graph_count, explanation.graph_break_count, tuple(breaks))


#: One ``torch.compile`` mode on one training step: the first call (compiling included), the
#: median step after it, and the final loss.
CompileModeRow = namedtuple("CompileModeRow", "mode first_call_seconds step_seconds loss")


def fresh_compile(model: Callable, *, fullgraph: bool = True, **options) -> Callable:
    """``torch.compile`` after ``torch._dynamo.reset()``, which empties dynamo's caches: past
    their limit it runs eager code, which ``fullgraph=True`` makes an error (chapter 7)."""
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=fullgraph, **options)


def compare_compile_modes(
    make_model: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device | str,
    modes: Sequence[str] = ("eager", "default", "reduce-overhead", "max-autotune"), *,
    repeats: int = 20, backend: str = "inductor",
) -> list[CompileModeRow]:
    """Time one SGD training step of a fresh, seeded ``make_model()`` per ``torch.compile`` mode
    ("eager": not compiled) with :func:`fresh_compile`; the first call includes compiling
    (chapter 7). Tests pass ``backend="eager"`` (dynamo's graph run as is)."""
    device = as_device(device)
    X, y = (t.to(device) for t in batch)
    rows = []
    for mode in modes:
        torch.manual_seed(0)
        net = make_model().to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

        def step(net=net, optimizer=optimizer) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(net(X), y)
            loss.backward()
            optimizer.step()
            return loss

        run = step
        if mode != "eager":
            options = {} if mode == "default" else {"mode": mode}
            # fullgraph=False: the step breaks at loss.backward() and before the update.
            compiled = fresh_compile(step, fullgraph=False, backend=backend, **options)
            graphs = mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"

            def run(compiled=compiled, graphs=graphs) -> torch.Tensor:
                if graphs:  # a new step: the previous replay's outputs may be overwritten
                    torch.compiler.cudagraph_mark_step_begin()
                return compiled()

        first = time_fn(run, device, warmup=0, repeats=1).median
        timing = time_fn(run, device, warmup=2, repeats=repeats)
        rows.append(CompileModeRow(mode, first, timing.median, run().item()))
    return rows
