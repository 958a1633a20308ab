"""Where the time goes: profiler traces read and drawn, the roofline, the fast path as an
ablation, torch.compile's graph breaks, CUDA graphs by hand, and memory timelines.

Chapter 7 uses these helpers. A stopwatch says how long a step took; a profiler says
what the step was made of:

* ``torch.profiler`` records every operator the host ran (and, on a GPU, every kernel
  and every CUDA runtime call) with its start and duration. :func:`read_trace` reads
  the Chrome trace it writes into :class:`TraceEvent` rows, :func:`summarize_trace`
  counts what a training loop did per step (``.item()`` synchronisations, DataLoader
  fetches), and :func:`plot_timeline` draws the rows as lanes with the idle gaps
  shaded, for readers without a trace viewer.
* :class:`Roofline` places operations by arithmetic intensity (FLOPs per byte moved)
  under the two ceilings of a device, measured here: matmul throughput and copy
  bandwidth. Each lands in one of three regimes: compute-bound, memory-bound, or
  overhead-bound (far below both roofs: the time goes to launching, not to work).
* :func:`run_ablation` trains the same model once per row of :func:`ablation_plan`,
  adding one technique of :class:`d2lgpu.Techniques` at a time, and reports images/s
  and the model FLOPs utilisation (MFU: achieved FLOP/s over the device's peak).
* :func:`explain_graph_breaks` asks ``torch._dynamo.explain`` where ``torch.compile``
  had to split a function, :func:`compare_compile_modes` times the compile modes, and
  :func:`capture_training_step` records a whole training step as one CUDA graph.
* :func:`memory_timeline_from_snapshot` and :func:`memory_timeline_from_trace` turn
  PyTorch's allocator history (GPU) or the profiler's memory events (CPU) into a
  timeline of allocated bytes that :func:`plot_memory_timeline` draws.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import itertools
import json
import logging
import math
import os
import pickle
import statistics
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from d2lgpu.benchmarking import copy_buffer_bytes, measure_copy_bandwidth
from d2lgpu.chips import peak_format
from d2lgpu.data import DeviceLoader
from d2lgpu.fast import TECHNIQUES, Techniques, make_sgd, technique_skip_reason, train_fast
from d2lgpu.precision import precision_policy, saved_activation_bytes
from d2lgpu.runtime.checks import (
    check_bool,
    check_positive_float,
    check_positive_int,
    check_sequence,
)
from d2lgpu.runtime.config import small_data, smoke_mode, workload
from d2lgpu.runtime.gpus import as_device, cuda_usable
from d2lgpu.timing import format_table, gbps, tflops, time_fn
from d2lgpu.training import History

__all__ = [
    "ABLATION_LABELS",
    "AblationNumbers",
    "AblationRow",
    "COUNT_UNITS",
    "COUNTED_ON_CPU",
    "AblationStep",
    "CompileModeRow",
    "DATALOADER_PREFIX",
    "GraphBreak",
    "GraphBreakReport",
    "Roofline",
    "RooflinePoint",
    "SlowStorage",
    "SYNC_OPS",
    "TraceEvent",
    "TraceSummary",
    "AblationSettings",
    "QUICK_COMPILE_SKIP",
    "QUICK_FUSED_SKIP",
    "ablation_data",
    "ablation_numbers",
    "ablation_plan",
    "ablation_settings",
    "capture_training_step",
    "compare_compile_modes",
    "explain_graph_breaks",
    "paired_multiply_add_ratio",
    "fresh_compile",
    "previous_ran",
    "speed_ratios",
    "format_ablation_table",
    "idle_gaps",
    "measure_roofline",
    "measure_stream_bandwidth",
    "memory_timeline_from_snapshot",
    "memory_timeline_from_trace",
    "merge_intervals",
    "mfu_note",
    "op_table",
    "plot_memory_timeline",
    "plot_roofline",
    "plot_timeline",
    "profiler_activities",
    "read_trace",
    "roofline_points",
    "run_ablation",
    "runs_dir",
    "steady_images_per_second",
    "summarize_trace",
    "timeline_lanes",
    "training_window",
]

# --------------------------------------------------------------------------- #
# Where traces and snapshots go
# --------------------------------------------------------------------------- #


def runs_dir(name: str) -> Path:
    """A directory for traces and snapshots, created if needed (chapter 7).

    ``runs/<name>`` at the root of the course's source checkout, which git ignores
    (``/runs/`` in ``.gitignore``); elsewhere (the package installed with pip, e.g. on
    Colab) ``d2lgpu-runs/<name>`` under the system's temporary directory.
    """
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"name must be one plain directory name such as 'ch7', got {name!r}")
    root = Path(__file__).resolve().parent.parent
    gitignore = root / ".gitignore"
    if gitignore.is_file() and "/runs/" in gitignore.read_text(encoding="utf-8").split():
        base = root / "runs"
    else:
        base = Path(tempfile.gettempdir()) / "d2lgpu-runs"
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------- #
# Profiling and reading traces
# --------------------------------------------------------------------------- #

#: Host operators that wait for the device: ``.item()`` (and ``float(t)``, ``if t:``)
#: run ``aten::item``, which copies one value back and must wait for it.
SYNC_OPS = ("aten::item",)

#: The name every DataLoader fetch has in a trace: torch wraps ``__next__`` in a
#: ``record_function`` called ``enumerate(DataLoader)#<iterator class>.__next__``.
DATALOADER_PREFIX = "enumerate(DataLoader)"

#: Trace categories of work that runs on the GPU itself.
_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profiler_activities(device: torch.device | str) -> list[torch.profiler.ProfilerActivity]:
    """What ``torch.profiler.profile`` should record for work on ``device``: the host's
    operators always, and on a CUDA device the GPU's kernels and copies too (chapter 7).

    For a CPU it also quiets the log lines of Kineto, the profiler's engine, unless
    ``KINETO_LOG_LEVEL`` is already set: without a GPU its only messages are a start
    and a stop line per profile and an "ERROR" that it found no GPU to count. (On a GPU
    its messages stay: they are where a CUPTI permission problem would show up.) It
    takes effect when the process starts its first profile.
    """
    device = as_device(device)
    if device.type == "cpu":
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above its highest level: silent
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def op_table(prof: torch.profiler.profile, top: int = 10, *, name_width: int = 44) -> str:
    """The ``top`` operators of a finished profile by self time, as a table of at most
    100 characters per line (``prof.key_averages().table()`` is about 200 wide) (chapter 7).

    "Self" time is time spent in the operator itself, not in the operators it called;
    sorted by self device time when the profile has device activity, else self CPU time.
    """
    if not callable(getattr(prof, "key_averages", None)):
        raise TypeError(
            f"op_table reads a finished torch.profiler.profile, got {type(prof).__name__}: "
            "use `with torch.profiler.profile(...) as prof:` and pass prof"
        )
    check_positive_int("top", top)
    check_positive_int("name_width", name_width)
    if name_width < 8:
        raise ValueError(f"name_width must be at least 8 characters, got {name_width}")
    averages = list(prof.key_averages())
    if not averages:
        raise ValueError("the profile recorded no operators: was anything run inside it?")

    def self_device(avg) -> float:
        return float(getattr(avg, "self_device_time_total", 0.0) or 0.0)

    has_device = any(self_device(avg) > 0 for avg in averages)
    key = self_device if has_device else (lambda avg: float(avg.self_cpu_time_total))
    rows = []
    for avg in sorted(averages, key=key, reverse=True)[:top]:
        name = avg.key if len(avg.key) <= name_width else avg.key[: name_width - 3] + "..."
        row = [name, str(avg.count), f"{avg.self_cpu_time_total / 1e3:.2f}",
               f"{avg.cpu_time_total / 1e3:.2f}"]
        if has_device:
            row.append(f"{self_device(avg) / 1e3:.2f}")
        rows.append(row)
    headers = ["operator", "calls", "self CPU ms", "CPU total ms"]
    if has_device:
        headers.append("self GPU ms")
    return format_table(headers, rows)


@dataclass(frozen=True)
class TraceEvent:
    """One event of a Chrome trace written by ``torch.profiler``.

    ``category`` is the trace's ``cat``: ``cpu_op`` (an operator on the host),
    ``user_annotation`` (a ``record_function`` range such as ``train_step`` or a
    DataLoader fetch), ``cuda_runtime`` (a CUDA API call such as a kernel launch),
    ``kernel``, ``gpu_memcpy``, ``gpu_memset`` (work on the GPU), or
    ``cpu_instant_event`` (the ``[memory]`` allocation events of ``profile_memory``).
    Times are microseconds; ``thread`` is the host thread, or the CUDA stream.
    """

    name: str
    category: str
    start_us: float
    duration_us: float
    thread: int
    args: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us

    @property
    def on_device(self) -> bool:
        return self.category in _DEVICE_CATEGORIES


def read_trace(path: str | Path) -> list[TraceEvent]:
    """The duration (``"X"``) and instant (``"i"``) events of a Chrome trace file
    (``prof.export_chrome_trace(path)``; ``.json`` or ``.json.gz``), sorted by start (chapter 7)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"read_trace takes the path of a trace file, got {type(path).__name__}: "
            "write one with prof.export_chrome_trace(path) and pass that path"
        )
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no trace at {path}: write one with prof.export_chrome_trace(path) first"
        ) from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory: pass the trace file inside it") from None
    except (ValueError, EOFError, OSError, zlib.error) as e:  # bad JSON, bad gzip, bad UTF-8
        raise ValueError(
            f"{path} is not a Chrome trace (JSON, or gzipped JSON named .gz) "
            f"[{type(e).__name__}: {e}]: write it with prof.export_chrome_trace(path)"
        ) from None
    raw = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(raw, list):
        raise ValueError(f"{path} is not a Chrome trace: it has no 'traceEvents' list")
    events = []
    for e in raw:
        if not isinstance(e, dict):
            continue
        phase = e.get("ph")
        if phase not in ("X", "i") or "ts" not in e:
            continue  # metadata, flow arrows, counters
        try:
            start, duration = float(e["ts"]), float(e.get("dur", 0.0)) if phase == "X" else 0.0
        except (TypeError, ValueError):
            raise ValueError(
                f"{path} is not a Chrome trace: event {e.get('name')!r} has the time "
                f"{e.get('ts')!r}/{e.get('dur')!r}, not numbers"
            ) from None
        args = e.get("args")
        events.append(TraceEvent(
            name=str(e.get("name", "")),
            category=str(e.get("cat", "")),
            start_us=start,
            duration_us=duration,
            thread=int(e.get("tid", 0)) if str(e.get("tid", 0)).lstrip("-").isdigit() else 0,
            args=args if isinstance(args, dict) else {},
        ))
    events.sort(key=lambda ev: (ev.start_us, -ev.duration_us))
    return events


def _named(events: Iterable[TraceEvent], name: str) -> list[TraceEvent]:
    return [e for e in events if e.name == name and e.duration_us > 0]


def _inside(event: TraceEvent, ranges: Sequence[TraceEvent]) -> bool:
    return any(
        r.thread == event.thread and r.start_us <= event.start_us and event.end_us <= r.end_us
        for r in ranges
    )


@dataclass(frozen=True)
class TraceSummary:
    """What a profiled training loop did, counted from its trace.

    ``item_calls`` counts :data:`SYNC_OPS` inside ``train_step`` ranges (each one a
    wait for the device); ``dataloader_fetches`` counts DataLoader fetches that
    delivered a training batch (they end before the last step does).
    """

    train_steps: int
    item_calls: int
    dataloader_fetches: int
    step_ms: float  # total time inside train_step ranges
    dataloader_ms: float  # total time of those fetches
    sync_ms: float  # total time of those .item() calls

    @property
    def item_calls_per_step(self) -> float:
        return self.item_calls / self.train_steps if self.train_steps else 0.0

    @property
    def dataloader_share(self) -> float:
        """Fetch time over fetch plus step time: the share of the loop spent waiting
        for batches."""
        total = self.step_ms + self.dataloader_ms
        return self.dataloader_ms / total if total > 0 else 0.0


def _check_events(events: object) -> list[TraceEvent]:
    """``events`` as a list if it holds TraceEvent s (read_trace's result), else a TypeError."""
    events = check_sequence("events", events, of="TraceEvent s (read_trace's result)",
                            allow_empty=True)
    for event in events:
        if not isinstance(event, TraceEvent):
            raise TypeError(f"events must hold the TraceEvent s of read_trace, got "
                            f"{type(event).__name__} among them")
    return events


def summarize_trace(events: Sequence[TraceEvent]) -> TraceSummary:
    """Count a training loop's steps, syncs and DataLoader fetches in its trace (chapter 7).

    Needs the ``train_step`` ranges that :func:`d2lgpu.train_fast` marks every step with.
    """
    events = _check_events(events)
    steps = _named(events, "train_step")
    if not steps:
        raise ValueError(
            "the trace has no 'train_step' ranges: profile a d2lgpu.train_fast call (it marks "
            "each step), or wrap your own steps in torch.profiler.record_function('train_step')"
        )
    syncs = [e for e in events if e.name in SYNC_OPS and _inside(e, steps)]
    last_end = max(s.end_us for s in steps)
    fetches = [
        e for e in events
        if e.name.startswith(DATALOADER_PREFIX) and e.duration_us > 0 and e.end_us <= last_end
    ]
    return TraceSummary(
        train_steps=len(steps),
        item_calls=len(syncs),
        dataloader_fetches=len(fetches),
        step_ms=sum(s.duration_us for s in steps) / 1e3,
        dataloader_ms=sum(f.duration_us for f in fetches) / 1e3,
        sync_ms=sum(s.duration_us for s in syncs) / 1e3,
    )


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching ``(start, end)`` intervals merged, sorted by start."""
    intervals = check_sequence("intervals", intervals, of="(start, end) pairs", allow_empty=True)
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"an interval ends before it starts: ({start}, {end})")
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def idle_gaps(
    busy: Iterable[tuple[float, float]], start: float, end: float, min_gap: float = 0.0
) -> list[tuple[float, float]]:
    """The parts of ``[start, end]`` not covered by ``busy`` intervals that last longer
    than ``min_gap``."""
    for name, value in (("start", start), ("end", end), ("min_gap", min_gap)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise TypeError(f"{name} must be a number of microseconds, got {value!r}")
    if end < start:
        raise ValueError(f"end ({end}) is before start ({start})")
    gaps = []
    cursor = start
    for a, b in merge_intervals(busy):
        if b <= cursor:
            continue
        if a > cursor and min(a, end) - cursor > min_gap:
            gaps.append((cursor, min(a, end)))
        cursor = max(cursor, b)
        if cursor >= end:
            break
    if end - cursor > min_gap:
        gaps.append((cursor, end))
    return gaps


def timeline_lanes(
    events: Sequence[TraceEvent], min_gap_us: float | None = None
) -> dict[str, list[tuple[float, float]]]:
    """The events of a trace as lanes of merged ``(start_us, end_us)`` intervals (chapter 7).

    Lanes: ``train steps``, ``DataLoader`` (fetches), ``.item() in steps`` (the syncs
    inside steps); on a GPU also ``host ops`` (operators on the thread that ran the
    steps) and ``GPU kernels``. ``idle``: gaps longer than ``min_gap_us`` in the lane
    that does the model's work (GPU kernels on a GPU; on a CPU the steps themselves)
    between the first and the last step. ``min_gap_us=None`` means 1% of that span.
    """
    events = _check_events(events)
    steps = _named(events, "train_step")
    if not steps:
        raise ValueError(
            "the trace has no 'train_step' ranges: profile a d2lgpu.train_fast call (it marks "
            "each step), or wrap your own steps in torch.profiler.record_function('train_step')"
        )
    lanes: dict[str, list[tuple[float, float]]] = {
        "train steps": [(s.start_us, s.end_us) for s in steps],
        "DataLoader": merge_intervals(
            (e.start_us, e.end_us) for e in events
            if e.name.startswith(DATALOADER_PREFIX) and e.duration_us > 0
        ),
        ".item() in steps": merge_intervals(
            (e.start_us, e.end_us) for e in events
            if e.name in SYNC_OPS and e.duration_us > 0 and _inside(e, steps)
        ),
    }
    kernels = merge_intervals((e.start_us, e.end_us) for e in events if e.on_device)
    if kernels:
        lanes["host ops"] = merge_intervals(
            (e.start_us, e.end_us) for e in events
            if e.category == "cpu_op" and e.duration_us > 0 and e.thread == steps[0].thread
        )
        lanes["GPU kernels"] = kernels
    worker = lanes["GPU kernels"] if kernels else lanes["train steps"]
    start, end = steps[0].start_us, max(s.end_us for s in steps)
    gap = 0.01 * (end - start) if min_gap_us is None else min_gap_us
    lanes["idle"] = idle_gaps(worker, start, end, gap)
    return lanes


def training_window(events: Sequence[TraceEvent]) -> tuple[float, float]:
    """The span of a trace's training steps, from the batch fetch before the first
    step (if any) to the end of the last step, in the trace's microseconds."""
    events = _check_events(events)
    steps = _named(events, "train_step")
    if not steps:
        raise ValueError("the trace has no 'train_step' ranges")
    first = steps[0].start_us
    before = [e.start_us for e in events if e.name.startswith(DATALOADER_PREFIX)
              and e.duration_us > 0 and e.end_us <= first]
    return (max(before) if before else first), max(s.end_us for s in steps)


_LANE_COLOURS = {
    "train steps": "tab:blue", "DataLoader": "tab:orange", "host ops": "tab:green",
    ".item() in steps": "tab:red", "GPU kernels": "tab:purple",
}


def plot_timeline(
    events: Sequence[TraceEvent],
    ax=None,
    *,
    title: str | None = None,
    window_us: tuple[float, float] | None = None,
    min_gap_us: float | None = None,
):
    """Draw a trace as horizontal lanes (:func:`timeline_lanes`), idle gaps hatched,
    time in ms from the first training step (chapter 7). ``window_us`` is the span to draw on the
    trace's own clock (default: :func:`training_window`). Returns the axes."""
    import matplotlib.pyplot as plt

    lanes = timeline_lanes(events, min_gap_us)
    window = training_window(events) if window_us is None else window_us
    origin = lanes["train steps"][0][0]
    names = [name for name in lanes if name != "idle"]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 * len(names) + 1.3))

    def clipped(spans):
        return [((max(a, window[0]) - origin) / 1e3, (min(b, window[1]) - max(a, window[0])) / 1e3)
                for a, b in spans if b > window[0] and a < window[1]]

    for row, name in enumerate(names):
        ax.broken_barh(clipped(lanes[name]), (row - 0.35, 0.7),
                       color=_LANE_COLOURS.get(name, "tab:gray"))
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
    if title:
        ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    return ax


# --------------------------------------------------------------------------- #
# Memory timelines
# --------------------------------------------------------------------------- #


def memory_timeline_from_trace(
    events: Sequence[TraceEvent], device: torch.device | str = "cpu"
) -> list[tuple[float, int]]:
    """``(time_us, bytes allocated)`` after every allocation and free on ``device``, from
    the ``[memory]`` events of a trace profiled with ``profile_memory=True`` (chapter 7)."""
    events = _check_events(events)
    device = as_device(device)
    code = {"cpu": 0, "cuda": 1}.get(device.type)
    if code is None:
        raise ValueError(f"memory events are recorded for cpu and cuda devices, not {device}")
    timeline = []
    for e in events:
        if e.name != "[memory]" or "Total Allocated" not in e.args:
            continue
        if int(e.args.get("Device Type", 0)) != code:
            continue
        if device.index is not None and int(e.args.get("Device Id", -1)) not in (device.index, -1):
            continue
        timeline.append((e.start_us, int(e.args["Total Allocated"])))
    if not timeline:
        raise ValueError(
            f"the trace has no memory events for {device}: profile with profile_memory=True"
        )
    return timeline


_SNAPSHOT_IS = ("a CUDA memory snapshot is the pickle that "
                "torch.cuda.memory._dump_snapshot(path) writes after "
                "torch.cuda.memory._record_memory_history()")


def _read_snapshot_file(path: Path) -> Mapping[str, Any]:
    """The snapshot pickled at ``path``; an error naming the file when it is not one."""
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a memory snapshot: {_SNAPSHOT_IS}")
    if not path.is_file():
        raise FileNotFoundError(f"no memory snapshot at {path}: {_SNAPSHOT_IS}")
    try:
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError) as err:
        raise ValueError(f"{path} is not a memory snapshot (it does not read as a pickle: "
                         f"{type(err).__name__}: {err}); {_SNAPSHOT_IS}") from None
    if not isinstance(snapshot, Mapping):
        raise ValueError(f"{path} holds a pickled {type(snapshot).__name__}, not a memory "
                         f"snapshot (a dict with 'segments' and 'device_traces'); {_SNAPSHOT_IS}")
    return snapshot


def memory_timeline_from_snapshot(
    snapshot: Mapping[str, Any] | str | Path, device_index: int = 0
) -> list[tuple[float, int]]:
    """``(time, bytes allocated)`` after every allocation and free in a CUDA memory snapshot
    (``torch.cuda.memory._snapshot()`` or the pickle ``_dump_snapshot`` writes) (chapter 7).

    The history only starts when ``_record_memory_history`` was switched on, so the
    bytes allocated before it (e.g. the weights) are worked out from the snapshot's
    segments: what is allocated at the end, minus what the history added. Time is the
    entry's ``time_us`` where torch records it, else its position in the history.
    """
    if not isinstance(snapshot, (Mapping, str, os.PathLike)) or isinstance(snapshot, bool):
        raise TypeError(f"snapshot must be torch.cuda.memory._snapshot() or the path of the "
                        f"pickle _dump_snapshot wrote, got {type(snapshot).__name__} {snapshot!r}")
    if not isinstance(snapshot, Mapping):
        snapshot = _read_snapshot_file(Path(snapshot))
    traces = snapshot.get("device_traces")
    if traces is None:
        raise ValueError("not a CUDA memory snapshot: it has no 'device_traces'")
    if not 0 <= device_index < len(traces):
        raise ValueError(f"the snapshot has {len(traces)} device(s), no index {device_index}")
    entries = traces[device_index]
    if not entries:
        raise ValueError(
            "the snapshot has no allocation history: call "
            "torch.cuda.memory._record_memory_history() before the work you want to see"
        )
    changes = []
    for i, entry in enumerate(entries):
        action = entry.get("action")
        sign = {"alloc": 1, "free_completed": -1}.get(action)
        if sign is None:
            continue
        changes.append((float(entry.get("time_us", i)), sign * int(entry["size"])))
    allocated_at_end = sum(
        block["size"]
        for segment in snapshot.get("segments", [])
        if segment.get("device", device_index) == device_index
        for block in segment.get("blocks", [])
        if block.get("state") == "active_allocated"
    )
    level = allocated_at_end - sum(change for _, change in changes)
    timeline = []
    for t, change in changes:
        level += change
        timeline.append((t, level))
    return timeline


def plot_memory_timeline(
    timeline: Sequence[tuple[float, int]],
    ax=None,
    *,
    spans: Sequence[tuple[float, float, str]] = (),
    title: str | None = None,
    time_unit: str = "ms",
):
    """Draw allocated memory (MiB) over time as a step line; ``spans`` are
    ``(start, end, label)`` ranges on the same clock to shade (e.g. training steps) (chapter 7).
    ``time_unit`` "ms" divides microseconds by 1000; "entry" plots positions as they are."""
    import matplotlib.pyplot as plt

    timeline = check_sequence("timeline", timeline, of="(time, bytes) pairs", allow_empty=True)
    if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in timeline):
        raise TypeError("timeline must hold (time, bytes) pairs, as memory_timeline_from_trace "
                        "and memory_timeline_from_snapshot return")
    if not timeline:
        raise ValueError("the timeline is empty")
    if time_unit not in ("ms", "entry"):
        raise ValueError(f"time_unit must be 'ms' or 'entry', got {time_unit!r}")
    scale = 1e3 if time_unit == "ms" else 1.0
    origin = timeline[0][0]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2))
    xs = [(t - origin) / scale for t, _ in timeline]
    ys = [b / 2**20 for _, b in timeline]
    ax.step(xs, ys, where="post", color="tab:blue", linewidth=1)
    for i, (a, b, label) in enumerate(spans):
        ax.axvspan((a - origin) / scale, (b - origin) / scale, alpha=0.12,
                   color="tab:orange" if i % 2 else "tab:green")
        ax.text((a - origin) / scale, max(ys) * 1.02, label, fontsize="x-small")
    ax.set_xlabel("time (ms)" if time_unit == "ms" else "allocator event")
    ax.set_ylabel("allocated (MiB)")
    ax.set_ylim(0, max(ys) * 1.12 + 1e-9)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return ax


# --------------------------------------------------------------------------- #
# The roofline
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class RooflinePoint:
    """One operation placed on a roofline: its FLOPs, the bytes it moves, its time (chapter 7)."""

    name: str
    flops: float
    nbytes: float
    seconds: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        for name, least in (("flops", "zero or more"), ("nbytes", "positive"),
                            ("seconds", "positive")):
            value = getattr(self, name)
            ok = (not isinstance(value, bool) and isinstance(value, (int, float))
                  and math.isfinite(value) and (value >= 0 if name == "flops" else value > 0))
            if not ok:
                raise ValueError(f"{name} must be a finite number, {least}, got {value!r}")

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved to or from memory."""
        return self.flops / self.nbytes

    @property
    def achieved_tflops(self) -> float:
        return tflops(self.flops, self.seconds)

    @property
    def achieved_gbps(self) -> float:
        return gbps(self.nbytes, self.seconds)


@dataclass(frozen=True)
class Roofline:
    """The two ceilings of a device: compute (TFLOP/s) and memory bandwidth (GB/s).

    An operation of intensity ``I`` FLOP/byte can at best reach
    ``min(peak, I * bandwidth)``. The *ridge* is the intensity where the two meet:
    below it an operation is limited by memory, above it by arithmetic.
    """

    peak_tflops: float
    bandwidth_gbps: float
    compute_label: str = "matmul"
    memory_label: str = "copy"
    #: every memory-roof candidate measured, e.g. {"copy": 20.1, "add": 22.9} (GB/s)
    bandwidths: Mapping[str, float] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "bandwidth_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.compute_label, str):
            raise TypeError(f"compute_label must be a str, got {self.compute_label!r}")
        if not isinstance(self.memory_label, str):
            raise TypeError(f"memory_label must be a str, got {self.memory_label!r}")
        if not isinstance(self.bandwidths, Mapping) or not all(
            isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float))
            and math.isfinite(v) and v > 0 for k, v in self.bandwidths.items()
        ):
            raise TypeError(f"bandwidths must map names to positive GB/s figures, e.g. "
                            f"{{'copy': 20.1}}, got {self.bandwidths!r}")

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the memory roof meets the compute roof."""
        return self.peak_tflops * 1e12 / (self.bandwidth_gbps * 1e9)

    def attainable_tflops(self, intensity: float) -> float:
        """The best TFLOP/s an operation of this intensity can reach on the device."""
        if not intensity > 0:
            raise ValueError(f"intensity must be positive, got {intensity!r}")
        return min(self.peak_tflops, intensity * self.bandwidth_gbps / 1e3)

    def regime(self, point: RooflinePoint, overhead_share: float = 0.1) -> str:
        """``"overhead-bound"`` when the point reaches less than ``overhead_share`` of
        its roof (neither memory nor arithmetic is what it waits for), else
        ``"memory-bound"`` left of the ridge and ``"compute-bound"`` right of it."""
        if not isinstance(point, RooflinePoint):
            raise TypeError(f"regime places a RooflinePoint, got {type(point).__name__}")
        if not 0 < overhead_share < 1:
            raise ValueError(f"overhead_share must be between 0 and 1, got {overhead_share}")
        if point.achieved_tflops < overhead_share * self.attainable_tflops(point.intensity):
            return "overhead-bound"
        return "memory-bound" if point.intensity < self.ridge else "compute-bound"


def _matmul_dtype(device: torch.device) -> torch.dtype:
    """The format matmuls run fast in on ``device``: its autocast format, else fp32."""
    from d2lgpu import precision

    return precision.precision_policy(device, "auto").dtype or torch.float32


def _event_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int,
                   repeats: int) -> float:
    """The best of ``repeats`` timings of ``fn()`` on ``device``'s current CUDA stream, each
    a pair of CUDA events recorded on that stream: the GPU's own clock, with no host
    wake-up in it. ``fn`` runs with ``device`` as the current device, so its kernels go
    to that stream even when another GPU is the process's current one."""
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in ms
    return min(times)


def _best_seconds(fn: Callable[[], object], device: torch.device, *, warmup: int = 1,
                  repeats: int = 5) -> float:
    """The best of ``repeats`` timings: CUDA events on a GPU, :func:`d2lgpu.time_fn`'s
    host clock elsewhere (CPU operators finish before they return)."""
    if device.type == "cuda":
        return _event_seconds(fn, device, warmup=warmup, repeats=repeats)
    return time_fn(fn, device, warmup=warmup, repeats=repeats).min


def measure_stream_bandwidth(
    device: torch.device | str, numel: int | None = None, *, repeats: int = 5
) -> float:
    """Bandwidth (GB/s) of an out-of-place elementwise add of two ``numel``-float
    tensors, counted as the 12 bytes per element the program asks for (read two, write
    one), best of ``repeats``. ``numel`` None: the buffer of
    :func:`d2lgpu.measure_copy_bandwidth`, far beyond the caches.

    Counted bytes are not always the bytes that move: on a CPU a kernel whose stores go
    through the caches first reads every line it writes (write-allocate), one whose
    stores bypass them (non-temporal stores, as large copies often use) does not. Which
    a kernel does is not visible from PyTorch, so the course measures the add, which
    writes the way the other elementwise operations do, beside the copy.
    Streaming elementwise operations are measured against this roof."""
    device = as_device(device)
    if numel is None:
        numel = max(copy_buffer_bytes(device)[0] // 4, 1)
    check_positive_int("numel", numel)
    check_positive_int("repeats", repeats)
    a = torch.randn(numel, device=device)
    b = torch.randn(numel, device=device)
    out = torch.empty_like(a)
    seconds = _best_seconds(lambda: torch.add(a, b, out=out), device, warmup=1, repeats=repeats)
    return gbps(12 * numel, seconds)


def paired_multiply_add_ratio(
    device: torch.device | str, numel: int, *, repeats: int = 15
) -> float:
    """A multiply's counted GB/s over an add's, both out of place on two ``numel``-float
    tensors (12 bytes per element each): the median over ``repeats`` pairs of the add's
    time over the multiply's, timed back to back (chapter 7). Each pair ran within milliseconds, so
    other work on the machine slows both of a pair alike and the median keeps the pairs
    that it did not split."""
    device = as_device(device)
    check_positive_int("numel", numel)
    check_positive_int("repeats", repeats)
    a = torch.randn(numel, device=device)
    b = torch.randn(numel, device=device)
    out = torch.empty_like(a)
    ratios = []
    for _ in range(repeats):
        add = _best_seconds(lambda: torch.add(a, b, out=out), device, warmup=1, repeats=1)
        mul = _best_seconds(lambda: torch.mul(a, b, out=out), device, warmup=1, repeats=1)
        ratios.append(add / mul)
    return statistics.median(ratios)


def measure_roofline(
    device: torch.device | str, matmul_n: int, *, repeats: int = 5,
    dtype: torch.dtype | None = None, stream_numel: int | None = None,
) -> tuple[Roofline, RooflinePoint]:
    """The device's roofline, measured: the compute roof is the best of ``repeats``
    ``matmul_n`` x ``matmul_n`` matmuls in ``dtype`` (None: the device's fast format,
    :func:`d2lgpu.precision_policy` "auto": bf16 on recent GPUs and on CPUs with native
    bf16, else fp32) (chapter 7). The memory roof is the higher of two measured bandwidths: a copy
    (:func:`d2lgpu.measure_copy_bandwidth`) and an elementwise add of ``stream_numel``
    floats (:func:`measure_stream_bandwidth`), each counted in the bytes the program
    asks for; on a CPU, where caches read a line before writing it, the add reads
    higher. Times come from CUDA events on a GPU, the host clock on a CPU, and each is
    the best of its runs: other work on the machine only ever makes a run slower. Also
    returns the matmul as a point, to place on the roofline."""
    device = as_device(device)
    if stream_numel is not None:
        check_positive_int("stream_numel", stream_numel)
    check_positive_int("matmul_n", matmul_n)
    check_positive_int("repeats", repeats)
    if dtype is None:
        dtype = _matmul_dtype(device)
    elif not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32 or None "
                         f"(the device's fast format), got {dtype!r}")
    a = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    b = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    seconds = _best_seconds(lambda: a @ b, device, warmup=1, repeats=repeats)
    flops = 2 * matmul_n**3
    nbytes = 3 * matmul_n * matmul_n * a.element_size()
    dtype_name = str(dtype).replace("torch.", "")
    bandwidths = {"copy": measure_copy_bandwidth(device),
                  "add": measure_stream_bandwidth(device, stream_numel, repeats=repeats)}
    memory_label = max(bandwidths, key=bandwidths.__getitem__)
    roof = Roofline(
        peak_tflops=tflops(flops, seconds),
        bandwidth_gbps=bandwidths[memory_label],
        compute_label=f"best {dtype_name} matmul",
        memory_label=memory_label,
        bandwidths=bandwidths,
    )
    point = RooflinePoint(f"matmul {matmul_n}x{matmul_n} {dtype_name}", flops, nbytes, seconds)
    return roof, point


def roofline_points(
    device: torch.device | str, *, elementwise_numel: int, tiny_numel: int = 8,
    tiny_repeats: int = 1000, repeats: int = 5,
) -> list[RooflinePoint]:
    """Two elementwise operations in fp32: a multiplication of two
    ``elementwise_numel``-element tensors (1 FLOP per 12 bytes moved), and the same on
    ``tiny_numel`` elements repeated ``tiny_repeats`` times, where each call is too
    small for its work to matter (chapter 7). Best of ``repeats`` runs, timed with CUDA events on
    a GPU and the host clock elsewhere."""
    device = as_device(device)
    for name, value in (("elementwise_numel", elementwise_numel), ("tiny_numel", tiny_numel),
                        ("tiny_repeats", tiny_repeats), ("repeats", repeats)):
        check_positive_int(name, value)
    points = []
    for name, numel, calls in (
        (f"multiply {elementwise_numel:,} floats", elementwise_numel, 1),
        (f"multiply {tiny_numel} floats x {tiny_repeats}", tiny_numel, tiny_repeats),
    ):
        a = torch.randn(numel, device=device)
        b = torch.randn(numel, device=device)
        out = torch.empty_like(a)

        def run(a=a, b=b, out=out, calls=calls):
            for _ in range(calls):
                torch.mul(a, b, out=out)

        seconds = _best_seconds(run, device, warmup=1, repeats=repeats)
        points.append(RooflinePoint(name, numel * calls, 12 * numel * calls, seconds))
    return points


def plot_roofline(roofline: Roofline, points: Sequence[RooflinePoint], ax=None, *,
                  title: str | None = None):
    """Draw the roofline (log-log) with ``points`` placed on it and labelled with their
    regime; FLOP/s in GFLOP/s when the peak is below 1 TFLOP/s (CPUs), else TFLOP/s (chapter 7).
    Returns the axes."""
    import matplotlib.pyplot as plt

    if not isinstance(roofline, Roofline):
        raise TypeError(f"roofline must be a Roofline (measure_roofline's first result), "
                        f"got {type(roofline).__name__}")
    points = check_sequence("points", points, of="RooflinePoint s", allow_empty=True)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5))
    scale, unit = (1e3, "GFLOP/s") if roofline.peak_tflops < 1 else (1.0, "TFLOP/s")
    intensities = [p.intensity for p in points] + [roofline.ridge]
    lo, hi = min(intensities) / 8, max(intensities) * 8
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [roofline.attainable_tflops(x) * scale for x in xs], color="black",
            linewidth=1.5)
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
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.2)
    return ax


# --------------------------------------------------------------------------- #
# The fast path as an ablation
# --------------------------------------------------------------------------- #

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
    """One row of the ablation: the techniques switched on so far, or why this row's
    technique is skipped (then ``techniques`` equals the previous row's)."""

    technique: str | None  # None for the baseline
    techniques: Techniques
    skip_reason: str | None = None

    @property
    def label(self) -> str:
        return ABLATION_LABELS[self.technique]


def ablation_plan(
    device: torch.device | str, skip: Mapping[str, str] | None = None
) -> list[AblationStep]:
    """The rows of the ablation on ``device``: the d2l-style baseline, then one technique
    of :data:`d2lgpu.fast.TECHNIQUES` added per row (chapter 7). A technique that does not apply on
    ``device`` (:func:`d2lgpu.technique_skip_reason`), or that ``skip`` names with a
    reason, gets a skipped row and stays off in the rows after it."""
    device = as_device(device)
    if skip is not None and not isinstance(skip, Mapping):
        raise TypeError(f"skip must map technique names to reasons, e.g. "
                        f"{{'compile': 'too slow here'}}, got {type(skip).__name__} {skip!r}")
    skip = dict(skip or {})
    unknown = set(skip) - set(TECHNIQUES)
    if unknown:
        raise ValueError(f"skip names unknown techniques {sorted(unknown)}; see {TECHNIQUES}")
    current = Techniques.d2l_style()
    plan = [AblationStep(None, current)]
    for name in TECHNIQUES:
        reason = skip.get(name) or technique_skip_reason(name, device)
        if reason is None:
            # The precision row lets the device pick its fast format; the others are switches.
            current = current.replace(**{name: "auto" if name == "precision" else True})
        plan.append(AblationStep(name, current, reason))
    return plan


@dataclass(frozen=True)
class AblationRow:
    """A measured (or skipped) row of the ablation. ``speeds`` are the images/s of every
    epoch after the first, over all of the row's runs; ``images_per_second`` is their
    median; ``history`` is the first run's."""

    step: AblationStep
    history: History | None = None
    images_per_second: float | None = None  # median of the epochs after the first
    mfu: float | None = None  # achieved FLOP/s over the device's peak
    speeds: tuple[float, ...] = ()
    # Per run (round), the images/s of its epochs after the first: rows of the same
    # round ran one after the other, so their epochs pair up (see speed_ratios).
    round_speeds: tuple[tuple[float, ...], ...] = ()
    # On a CPU, for the techniques of COUNTED_ON_CPU: what the technique changes,
    # counted on this row's model and data (count_technique_effect): (before, after),
    # in the unit of COUNT_UNITS[technique]. Shown beside the timed ratio, not instead.
    counted: tuple[float, float] | None = None

    @property
    def label(self) -> str:
        return self.step.label

    @property
    def ran(self) -> bool:
        return self.history is not None

    @property
    def status(self) -> str:
        return "ran" if self.ran else f"skipped: {self.step.skip_reason}"

    @property
    def test_acc(self) -> float | None:
        return self.history.test_acc[-1] if self.history is not None else None

    @property
    def first_epoch_seconds(self) -> float | None:
        return self.history.epoch_seconds[0] if self.history is not None else None

    @property
    def spread(self) -> float | None:
        """(fastest - slowest) / median of ``speeds``; None with fewer than two."""
        if len(self.speeds) < 2:
            return None
        return (max(self.speeds) - min(self.speeds)) / statistics.median(self.speeds)


def steady_images_per_second(history: History) -> float:
    """Training images/s of a run: the median of its epochs after the first (whose
    one-off costs, such as compiling, are left out); the only epoch when there is one.
    The median, because one epoch that other work on a shared machine slowed down (or
    one that ran alone while its neighbours did not) moves it little."""
    if not isinstance(history, History):
        raise TypeError(f"steady_images_per_second reads a d2lgpu.History, got "
                        f"{type(history).__name__}")
    speeds = history.examples_per_second
    if not speeds:
        raise ValueError("the history has no epochs")
    return statistics.median(speeds[1:] or speeds)


def speed_ratios(row: AblationRow, before: AblationRow) -> tuple[float, ...]:
    """``row``'s speed over ``before``'s, epoch by epoch: epoch k after the first of run r
    of ``row`` over epoch k of run r of ``before``. The runs are interleaved, so the two
    epochs of a pair ran minutes apart at most, and a busy spell of the machine that
    slows both cancels in their ratio."""
    if not (isinstance(row, AblationRow) and isinstance(before, AblationRow)):
        raise TypeError("speed_ratios compares two AblationRow s of run_ablation")
    return tuple(
        mine / theirs
        for run, run_before in zip(row.round_speeds, before.round_speeds, strict=False)
        for mine, theirs in zip(run, run_before, strict=False)
    )


def previous_ran(rows: Sequence[AblationRow], row: AblationRow) -> AblationRow:
    """The row that ran last before ``row`` (``row`` itself for the first that ran): the
    reference of ``row``'s technique, since every row adds one technique to it (chapter 7)."""
    rows = list(rows)
    before = [r for r in rows[: rows.index(row)] if r.ran]
    return before[-1] if before else row


def mfu_note(device: torch.device | str, peak: float | None) -> str:
    """Why MFU is or is not reported on ``device``, in one line (chapter 7)."""
    device = as_device(device)
    if peak is not None:
        check_positive_float("peak", peak)
        dtype = peak_format(device) if device.type == "cuda" else None
        return (f"MFU: counted matmul/conv FLOPs over the {peak:g} TFLOP/s "
                f"{dtype + ' ' if dtype else ''}data-sheet peak")
    if device.type == "cpu":
        return "MFU n/a: a CPU has no data-sheet Tensor Core peak to divide by"
    return f"MFU n/a: no data-sheet peak listed for {torch.cuda.get_device_name(device)}"


@dataclass(frozen=True)
class AblationSettings:
    """How big the ablation of chapter 7 (and ``benchmarks/ablation.py``) is."""

    model: str  # a d2lgpu model function: "resnet18" or "small_cnn"
    batch_size: int
    num_epochs: int
    lr: float
    train_size: int | None  # None: the whole split (the quick subset in quick mode)
    test_size: int | None
    skip: Mapping[str, str] = field(default_factory=dict)  # technique -> reason
    repeats: int = 1  # runs per row, interleaved: round 1 of every row, then round 2

    def make_model(self) -> nn.Module:
        from d2lgpu import models

        return getattr(models, self.model)()

    def describe(self) -> str:
        examples = "quick subset" if self.train_size is None and small_data() else (
            "all" if self.train_size is None else f"{self.train_size:,}")
        runs = f", {self.repeats} runs per row" if self.repeats > 1 else ""
        return (f"{self.model}, {examples} training images, batch {self.batch_size}, "
                f"{self.num_epochs} epochs, lr {self.lr}{runs}")



#: Why quick mode leaves torch.compile out of the ablation.
QUICK_COMPILE_SKIP = "quick mode: compiling takes tens of seconds or more on a CPU"


#: Why quick mode leaves the fused optimizer's row out (chapter 7 checks fused SGD itself).
QUICK_FUSED_SKIP = "quick mode: one row fewer; section 5.5 checks fused SGD"


def ablation_settings(chosen: str | None = None) -> AblationSettings:
    """The ablation's size for a workload (:func:`d2lgpu.workload`; None: this process's)
    (chapter 7).

    ``full`` (a GPU): ResNet-18 on 15,000 Fashion-MNIST training images and the 10,000 test
    images, the d2l recipe's batch 256: by ``benchmarks/full_mode_estimate.py`` about 24 min
    on a T4 (Colab's free GPU), where all 60,000 would take about 51.
    ``cpu``: the small CNN on 3,200 training images, batch 64, a few minutes in all (short
    runs, so that the two epochs of a pair run close together on a busy machine).
    ``quick``: the small CNN on the quick subset, batch 32, torch.compile and the fused
    optimizer left out. ``full`` and ``cpu`` run every row twice, interleaved, 3 epochs
    each: 4 paired epochs per row against the row before (:func:`speed_ratios`).
    ``quick`` runs each row once for 2 epochs: one paired epoch, numbers for checking.
    """
    if chosen is not None and not isinstance(chosen, str):
        raise TypeError(f"chosen must be 'quick', 'cpu', 'full' or None (this process's "
                        f"workload), got {type(chosen).__name__} {chosen!r}")
    chosen = workload() if chosen is None else chosen
    if chosen == "full" and smoke_mode():  # full mode's rows, four small batches
        # On a CPU, technique_skip_reason leaves the compile row out in smoke mode, and the
        # chapter's cells train CPU mode's model: with ResNet-18 on two cores, the smoke run
        # of chapter 7 took about 190 s of test time, most of it in cells outside the ablation.
        model = "resnet18" if cuda_usable() else "small_cnn"
        return AblationSettings(model, 8, 2, 0.1, 32, 16, repeats=1)
    if chosen == "full":
        return AblationSettings("resnet18", 256, 3, 0.1, 15_000, 10_000, repeats=2)
    if chosen == "cpu":
        return AblationSettings("small_cnn", 64, 3, 0.1, 3200, 2000, repeats=2)
    if chosen == "quick":
        return AblationSettings("small_cnn", 32, 2, 0.1, None, None,
                                {"compile": QUICK_COMPILE_SKIP,
                                 "fused_optimizer": QUICK_FUSED_SKIP})
    raise ValueError(f"unknown workload {chosen!r}: choose quick, cpu or full")


def ablation_data(
    batch_size: int,
    device: torch.device | str,
    *,
    train_size: int | None = None,
    test_size: int | None = None,
    quick: bool | None = None,
) -> tuple[tuple[Iterable, Iterable], tuple[DeviceLoader, DeviceLoader]]:
    """The same Fashion-MNIST examples twice: as DataLoaders (the d2l-style pipeline,
    :func:`d2lgpu.load_data_fashion_mnist`) and as :class:`d2lgpu.DeviceLoader` s on
    ``device`` (:func:`d2lgpu.fashion_mnist_on_device`), for :func:`run_ablation` (chapter 7).

    ``train_size``/``test_size`` keep the first that many examples of each split
    (None: all of it) of the data; ``quick`` (None: quick and smoke mode) starts from the
    quick subsets.
    """
    from torch.utils import data as tud

    from d2lgpu.data import fashion_mnist_tensors, load_data_fashion_mnist

    device = as_device(device)
    for name, size in (("train_size", train_size), ("test_size", test_size)):
        if size is not None:
            check_positive_int(name, size)
    check_bool("quick", quick, none_means="quick mode")
    quick = small_data() if quick is None else quick
    train_iter, test_iter = load_data_fashion_mnist(batch_size, quick=quick)
    loaders = []
    for loader, size, shuffle in ((train_iter, train_size, True), (test_iter, test_size, False)):
        if size is not None:
            check_positive_int("train_size/test_size", size)
            loader = tud.DataLoader(
                tud.Subset(loader.dataset, range(min(size, len(loader.dataset)))), batch_size,
                shuffle=shuffle, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                persistent_workers=loader.num_workers > 0,
            )
        loaders.append(loader)
    resident = []
    for train_split, size, shuffle in ((True, train_size, True), (False, test_size, False)):
        images, labels = fashion_mnist_tensors(train=train_split, quick=quick)
        if size is not None:
            images, labels = images[:size], labels[:size]
        resident.append(DeviceLoader(images, labels, batch_size if train_split else
                                     max(batch_size, 1024), device=device, shuffle=shuffle))
    return (loaders[0], loaders[1]), (resident[0], resident[1])


#: The techniques whose gain on a GPU comes from something a CPU does not have: host
#: reads that stall a GPU's queue (``no_sync``), Tensor Cores (``precision``), kernel
#: launches (``fused_optimizer``). On a CPU their rows are timed like every row, and what
#: they change is counted as well (:func:`count_technique_effect`), since the CPU's clock
#: cannot show what they save on a GPU.
COUNTED_ON_CPU = ("no_sync", "precision", "fused_optimizer")

#: What :func:`count_technique_effect` counts for each technique, before -> after.
COUNT_UNITS = {
    "no_sync": ".item() reads a training step",
    "precision": "MiB autograd saves for backward a step",
    "fused_optimizer": "ATen operators an optimizer.step()",
}


def _host_reads(fn: Callable[[], Any]) -> int:
    """How many times ``fn()`` copies a scalar from a tensor to Python (``.item()``,
    ``float(t)``, ...): the profiler's ``aten::_local_scalar_dense`` events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::_local_scalar_dense")


def _top_level_ops(fn: Callable[[], Any]) -> int:
    """How many ATen operators ``fn()`` calls directly (not those they call in turn): on
    a GPU, about one kernel launch each."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))


def count_technique_effect(
    technique: str,
    make_model: Callable[[], nn.Module],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    device: torch.device | str,
    before: Techniques,
) -> tuple[float, float]:
    """What switching ``technique`` on (on top of ``before``) changes, counted: the count
    without it and with it, in the unit of :data:`COUNT_UNITS` ``[technique]``.
    ``batches``: training batches on ``device`` (the row's own loader; the first 4 are used).

    * ``no_sync``: host reads (``.item()``) per training step, from epochs of 2 and 4
      of ``batches`` (at least 4); on a GPU each one waits for everything queued;
    * ``precision``: bytes autograd saves for backward in one step (activations),
      under ``before``'s precision and under "auto";
    * ``fused_optimizer``: ATen operators one ``optimizer.step()`` calls, torch's
      default SGD against :func:`d2lgpu.fast.make_sgd`'s.
    """
    device = as_device(device)
    batches = list(itertools.islice(iter(batches), 4))
    if not batches:
        raise ValueError("count_technique_effect needs at least one batch")
    if technique == "no_sync":
        if len(batches) < 4:
            raise ValueError("counting the reads of a step needs 4 batches")

        def reads_per_step(no_sync: bool) -> float:
            # An epoch of 4 steps less one of 2: what the epoch's ends read cancels.
            # The batches as a list: where they come from does not change the reads.
            switches = before.replace(no_sync=no_sync, device_data=False)
            reads = [_host_reads(lambda n=n: train_fast(
                make_model().to(device), batches[:n], batches[:1], 1, lr, device, seed=0,
                techniques=switches, progress=False)) for n in (2, 4)]
            return (reads[1] - reads[0]) / 2

        return reads_per_step(False), reads_per_step(True)
    if technique == "precision":
        X, y = batches[0]
        saved = []
        for precision in (before.precision, "auto"):
            torch.manual_seed(0)
            saved.append(saved_activation_bytes(make_model().to(device), X, y,
                                                precision_policy(device, precision)))
        return saved[0] / 2**20, saved[1] / 2**20
    if technique == "fused_optimizer":
        ops = []
        for make in (lambda ps: torch.optim.SGD(ps, lr=lr), lambda ps: make_sgd(ps, lr, device)):
            torch.manual_seed(0)
            net = make_model().to(device)
            optimizer = make(net.parameters())
            X, y = batches[0]
            nn.functional.cross_entropy(net(X), y).backward()
            optimizer.step()  # the first step creates state; count the second
            ops.append(_top_level_ops(optimizer.step))
        return float(ops[0]), float(ops[1])
    raise ValueError(f"technique must be one of {COUNTED_ON_CPU} to be counted, got {technique!r}")


def run_ablation(
    make_model: Callable[[], nn.Module],
    plan: Sequence[AblationStep],
    dataloaders: tuple[Iterable, Iterable],
    device_loaders: tuple[Iterable, Iterable],
    num_epochs: int,
    lr: float,
    device: torch.device | str,
    *,
    seed: int = 0,
    flops_per_example: float | None = None,
    peak: float | None = None,
    on_row: Callable[[AblationRow], None] | None = None,
    on_run: Callable[[AblationStep], None] | None = None,
    repeats: int = 1,
) -> list[AblationRow]:
    """Train a fresh ``make_model()`` for every row of ``plan`` that is not skipped, with
    :func:`d2lgpu.train_fast` and the row's techniques, from the same seed; ``repeats`` times,
    interleaved (every row once, then every row again in reverse order, and so on), so
    that a busy spell of the machine falls on all rows alike rather than on one, and a
    load that drifts up or down favours neither side of a pair in every round (chapter 7).

    Rows without ``device_data`` read ``dataloaders`` (train, test DataLoaders), rows
    with it ``device_loaders`` (:class:`d2lgpu.DeviceLoader` s of the same examples).
    A row's speed is the median images/s of all its epochs after the first.
    ``flops_per_example`` (:func:`d2lgpu.training_flops_per_example`) and ``peak``
    (:func:`d2lgpu.peak_tflops`) give the MFU; without a peak it is None. ``on_row`` is
    called once per row, in the order of ``plan``, when all runs are done; ``on_run`` after
    every run of every row, skipped ones included (e.g. to move a progress bar on).
    """
    if not callable(make_model):
        raise TypeError("make_model must be a function that returns a fresh model, e.g. "
                        "d2lgpu.small_cnn")
    plan = list(plan)
    if not plan or not all(isinstance(step, AblationStep) for step in plan):
        raise TypeError("plan must be a non-empty list of AblationStep s: use ablation_plan()")
    check_positive_int("num_epochs", num_epochs)
    check_positive_int("repeats", repeats)
    device = as_device(device)
    if on_row is not None and not callable(on_row):
        raise TypeError(f"on_row must be a function of one AblationRow, got {on_row!r}")
    if on_run is not None and not callable(on_run):
        raise TypeError(f"on_run must be a function of one AblationStep, got {on_run!r}")
    histories: list[list[History]] = [[] for _ in plan]
    for round_ in range(repeats):
        # Every other round runs the rows in reverse order: a load that rises or falls
        # during the ablation then favours the later row of a pair in one round and the
        # earlier one in the next, instead of every row over the one before it.
        order = range(len(plan)) if round_ % 2 == 0 else reversed(range(len(plan)))
        for i in order:
            step = plan[i]
            if step.skip_reason is None:
                train_iter, test_iter = (device_loaders if step.techniques.device_data
                                         else dataloaders)
                if step.techniques.compile or step.techniques.cuda_graphs:
                    # Every run compiles a fresh model: without emptying dynamo's caches
                    # the 8th entry (recompile_limit) would be the last compiled one.
                    # compile_model compiles with fullgraph=True, so that limit reached
                    # anyway is an error, not eager code timed as compiled.
                    torch._dynamo.reset()
                histories[i].append(train_fast(
                    make_model(), train_iter, test_iter, num_epochs, lr, device, seed=seed,
                    techniques=step.techniques, progress=False,
                ))
            if on_run is not None:
                on_run(step)
    rows: list[AblationRow] = []
    for step, runs in zip(plan, histories, strict=True):
        row = _ablation_row(step, runs, flops_per_example, peak)
        if row.ran and device.type == "cpu" and step.technique in COUNTED_ON_CPU:
            before = next(r for r in reversed(rows) if r.ran).step.techniques
            row = dataclasses.replace(row, counted=count_technique_effect(
                step.technique, make_model, device_loaders[0], lr, device, before))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _ablation_row(step: AblationStep, runs: Sequence[History],
                  flops_per_example: float | None, peak: float | None) -> AblationRow:
    if not runs:
        return AblationRow(step)
    round_speeds = tuple(tuple(h.examples_per_second[1:] or h.examples_per_second)
                         for h in runs)
    speeds = tuple(v for run in round_speeds for v in run)
    speed = statistics.median(speeds)
    mfu = None
    if peak is not None and flops_per_example is not None:
        mfu = speed * flops_per_example / (peak * 1e12)
    return AblationRow(step, runs[0], speed, mfu, speeds, round_speeds)


@dataclass(frozen=True)
class AblationNumbers:
    """One row of the ablation in numbers that agree with each other, all from the paired
    ratios of :func:`speed_ratios`: ``x_prev`` is their median against the row that ran
    before (1.0 for the baseline), ``low``/``high`` their smallest and largest, and
    ``images_per_second`` the baseline's median images/s times every ``x_prev`` down to
    this row, so that a row is drawn faster than the row before exactly when its
    ``x_prev`` is above 1. ``x_base`` is that speed over the baseline's; ``mfu`` is
    computed from it (None without a peak)."""

    row: AblationRow
    x_prev: float
    low: float
    high: float
    images_per_second: float
    x_base: float
    mfu: float | None


def ablation_numbers(rows: Sequence[AblationRow]) -> list[AblationNumbers | None]:
    """:class:`AblationNumbers` for every row of ``rows`` (run_ablation's result), None
    for a skipped row (chapter 7). The first row that ran is the baseline."""
    rows = check_sequence("rows", rows, of="AblationRow s (run_ablation's result)",
                          allow_empty=True)
    if not rows or not all(isinstance(r, AblationRow) for r in rows):
        raise TypeError("ablation_numbers takes the AblationRow s of run_ablation")
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
            if not ratios:
                raise ValueError(f"{r.label!r} and {before.label!r} have no epochs to pair: "
                                 "run_ablation's rows carry them")
            speed *= statistics.median(ratios)
        mfu = None if r.mfu is None else r.mfu * speed / r.images_per_second
        numbers.append(AblationNumbers(r, statistics.median(ratios), min(ratios), max(ratios),
                                       speed, speed / base_speed, mfu))
    return numbers


def format_ablation_table(rows: Sequence[AblationRow]) -> str:
    """The ablation's numbers (:func:`ablation_numbers`) as a text table of at most 100
    characters a line: "x prev" (the median of the paired ratios against the row before)
    and their range, images/s chained from the baseline by those medians, "x base", MFU,
    first-epoch seconds (compiling included) and test accuracy. Skipped rows give their
    reason; counted rows (:data:`COUNTED_ON_CPU`) their counts under the table. No verdict:
    the reader of the numbers draws it."""
    numbers = ablation_numbers(rows)
    width = max(len(r.label) for r in rows)
    header = (f"{'step':<{width}}  {'x prev':>6}  {'pairs':>9}  {'img/s':>7}  {'x base':>6}  "
              f"{'MFU':>5}  {'epoch1 s':>8}  {'test acc':>8}")
    lines = [header, "-" * len(header)]
    for r, n in zip(rows, numbers, strict=True):
        if n is None:
            lines.append(f"{r.label:<{width}}  skipped: {r.step.skip_reason}")
            continue
        mfu = "n/a" if n.mfu is None else f"{100 * n.mfu:.1f}%"
        pairs = f"{n.low:.2f}-{n.high:.2f}"
        lines.append(
            f"{r.label:<{width}}  {n.x_prev:>5.2f}x  {pairs:>9}  {n.images_per_second:>7,.0f}  "
            f"{n.x_base:>5.2f}x  {mfu:>5}  {r.first_epoch_seconds:>8.2f}  {r.test_acc:>8.3f}")
    lines.append("x prev: median of the epoch-by-epoch ratios to the row before; pairs: "
                 "their range")
    lines.append("img/s: the baseline's median times the x prev of every row down to this one")
    lines.extend(f"  {r.label}: {COUNT_UNITS[r.step.technique]} {r.counted[0]:.3g} -> "
                 f"{r.counted[1]:.3g}, counted" for r in rows if r.ran and r.counted)
    return "\n".join(lines)


class SlowStorage(torch.utils.data.Dataset):
    """``dataset`` whose every item arrives ``latency`` seconds late, as from a disk or a
    network share: a sleep, in which the host waits and does no work, so that what
    DataLoader workers hide shows on any machine, a busy one included. Chapter 7 times
    its input pipeline on it. In the package rather than the notebook so that worker
    processes started with ``spawn`` (macOS, Windows) can import it."""

    def __init__(self, dataset: torch.utils.data.Dataset, latency: float) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset must be a map-style Dataset (len and indexing), got "
                            f"{type(dataset).__name__}")
        self.dataset = dataset
        self.latency = check_positive_float("latency", latency)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        import time

        time.sleep(self.latency)
        return self.dataset[index]


# --------------------------------------------------------------------------- #
# torch.compile: graph breaks and modes
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class GraphBreak:
    """One place where ``torch.compile`` had to end a graph: the line of code, dynamo's
    reason (its first line) and its explanation."""

    code: str
    reason: str
    explanation: str


@dataclass(frozen=True)
class GraphBreakReport:
    """What ``torch._dynamo.explain`` found: how many graphs the function became, how
    many breaks split it, and each break."""

    graph_count: int
    break_count: int
    breaks: tuple[GraphBreak, ...]

    def describe(self, width: int = 100) -> str:
        """The report as lines of at most ``width`` characters."""
        lines = [f"{self.graph_count} graph(s), {self.break_count} graph break(s)"]
        for i, b in enumerate(self.breaks, 1):
            lines.append(f"break {i} at: {b.code}")
            lines.append(f"    reason: {b.reason}")
            if b.explanation:
                lines.append(f"    {b.explanation}")
        return "\n".join(
            line if len(line) <= width else line[: width - 3] + "..." for line in lines
        )


@contextlib.contextmanager
def _quiet_dynamo() -> Iterator[None]:
    """Dynamo logs each graph break as a warning with a stack; the report says it once."""
    logger = logging.getLogger("torch._dynamo")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def explain_graph_breaks(fn: Callable, *args, **kwargs) -> GraphBreakReport:
    """Trace ``fn(*args, **kwargs)`` with ``torch._dynamo.explain`` (no code generation:
    it takes a second, not a compile) and report its graphs and graph breaks (chapter 7)."""
    if not callable(fn):
        raise TypeError(f"fn must be the function or model to trace, got {type(fn).__name__}")
    with _quiet_dynamo():
        explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = []
    for item in explanation.break_reasons:
        text = str(getattr(item, "reason", item)).strip()
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        why = next((line for line in lines if line.startswith("Explanation:")), "")
        stack = getattr(item, "user_stack", None) or []
        code = (getattr(stack[-1], "line", "") or "").strip() if stack else ""
        breaks.append(GraphBreak(
            code=code or "?",
            reason=lines[0] if lines else "(no reason given)",
            explanation=why.removeprefix("Explanation:").strip(),
        ))
    return GraphBreakReport(explanation.graph_count, explanation.graph_break_count,
                            tuple(breaks))


@dataclass(frozen=True)
class CompileModeRow:
    """One ``torch.compile`` mode on one training step: the first call (compiling
    included), the median step after it, and the loss after all those steps (every
    mode starts from the same weights and runs as many steps, so losses must agree)."""

    mode: str
    first_call_seconds: float
    step_seconds: float
    loss: float


def fresh_compile(model: Callable, *, fullgraph: bool = True, **options) -> Callable:
    """``torch.compile(model, fullgraph=fullgraph, **options)`` after ``torch._dynamo.reset()``.

    Dynamo keeps compiled code per Python function (a module's ``forward``, shared by
    every instance of the class: dynamo inlines ``nn.Module`` s and takes their parameters
    as inputs, so a fresh instance adds no entry), up to
    ``torch._dynamo.config.recompile_limit`` entries (8 in torch 2.9 and 2.15); a new
    shape under ``dynamic=False``, a train/eval switch, autocast or another memory format
    adds one. Past the limit it runs the function eagerly with only a log
    warning, so a comparison of compiled models would time eager code under a compiled
    label. The reset empties the caches (every earlier compiled wrapper recompiles on its
    next call); ``fullgraph=True`` makes a graph break, or the limit reached anyway, an
    error instead of a silent fallback. A whole training step has graph breaks (at
    ``loss.backward()`` and in the optimizer's step), so it compiles with ``fullgraph=False``."""
    if not callable(model):
        raise TypeError(f"model must be a module or function to compile, got "
                        f"{type(model).__name__}")
    torch._dynamo.reset()
    return torch.compile(model, fullgraph=fullgraph, **options)


def compare_compile_modes(
    make_model: Callable[[], nn.Module],
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device | str,
    modes: Sequence[str] = ("eager", "default", "reduce-overhead", "max-autotune"),
    *,
    repeats: int = 20,
    seed: int = 0,
    backend: str = "inductor",
) -> list[CompileModeRow]:
    """Time one SGD training step of a fresh ``make_model()`` (seeded with ``seed``) per
    ``torch.compile`` mode ("eager": not compiled) on ``batch``; the first call
    includes the compilation (chapter 7). Each mode compiles the *whole step function*, forward,
    backward and the optimizer's update, with :func:`fresh_compile` (dynamo's caches
    emptied, ``fullgraph=True``), so no mode runs past the recompile limit. Modes with
    CUDA graphs mark each step's start (``torch.compiler.cudagraph_mark_step_begin``).
    ``backend`` is inductor's; tests pass "eager" (dynamo's graph, run as is)."""
    device = as_device(device)
    X, y = (t.to(device) for t in batch)
    rows = []
    for mode in modes:
        torch.manual_seed(seed)
        net = make_model().to(device)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

        def step(net=net, optimizer=optimizer) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(net(X), y)
            loss.backward()
            optimizer.step()
            return loss

        if mode == "eager":
            run = step
        else:
            options = {} if mode == "default" else {"mode": mode}
            # The step breaks at loss.backward(): forward and loss are one graph (their
            # backward generated with it), the optimizer's update another.
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


# --------------------------------------------------------------------------- #
# CUDA graphs by hand
# --------------------------------------------------------------------------- #


def capture_training_step(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    example: tuple[torch.Tensor, torch.Tensor],
    *,
    warmup_steps: int = 3,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Record one whole training step (forward, backward, optimizer step) as a CUDA
    graph; return ``step(X, y)``, which copies the batch into the graph's input tensors,
    replays the graph and returns the loss tensor (overwritten by the next replay) (chapter 7).

    The rules a graph imposes: every batch has ``example``'s shapes and dtypes (static
    shapes); the inputs live at fixed addresses, so batches are copied in, and the
    outputs are the same tensors every replay (static memory); nothing in the step may
    synchronise with the host or branch on a tensor's value; the learning rate is the
    number the optimizer had when recording. ``warmup_steps`` real steps on ``example``
    run first on a side stream (torch's recipe: lazy state such as momentum buffers
    and cuBLAS workspaces must exist before recording). Needs a CUDA device.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(example, (tuple, list)) and len(example) == 2
            and all(isinstance(t, torch.Tensor) for t in example)):
        raise TypeError(f"example must be an (X, y) pair of tensors, got "
                        f"{type(example).__name__} {example!r}"[:200])
    X0, y0 = example
    if X0.device.type != "cuda":
        raise ValueError(
            f"CUDA graphs record CUDA kernels; the example batch is on {X0.device}. "
            "Move the model and the batch to a GPU first"
        )
    device = X0.device
    static_X, static_y = X0.clone(), y0.clone()
    # Everything on the example's GPU: its streams, and it as the current device while
    # recording (torch.cuda.graph captures on the current device's stream).
    with torch.cuda.device(device):
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for _ in range(warmup_steps):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(static_X), static_y).backward()
                optimizer.step()
        main.wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        optimizer.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = loss_fn(model(static_X), static_y)
            static_loss.backward()
            optimizer.step()

    def step(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if X.shape != static_X.shape or y.shape != static_y.shape:
            raise ValueError(
                f"a CUDA graph replays fixed shapes: recorded {tuple(static_X.shape)} and "
                f"{tuple(static_y.shape)}, got {tuple(X.shape)} and {tuple(y.shape)} "
                "(drop the last partial batch, or run it eagerly)"
            )
        static_X.copy_(X)
        static_y.copy_(y)
        with torch.cuda.device(device):
            graph.replay()
        return static_loss

    return step
