"""The course's clock (chapter 2): CUDA runs asynchronously, so :func:`time_fn` waits for the
device before it starts the clock and again before it stops it; and the tables times go in."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from d2lgpu.runtime.checks import check_warmup_repeats
from d2lgpu.runtime.gpus import require_cuda_device

__all__ = ["DeviceLike", "Timing", "format_seconds", "format_table", "gbps", "synchronize",
           "tflops", "time_fn", "timed_calls", "timing_device"]

#: What the timers take as a device: a ``torch.device``, a name such as ``'cuda:0'``,
#: a GPU index, or None (whatever the timed function uses).
DeviceLike = torch.device | str | int | None


def format_seconds(seconds: float) -> str:
    """A duration with a readable unit: ``'3.20 ms'``, ``'41.0 us'``, ``'1.50 s'`` (chapter 2)."""
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e9:.0f} ns"


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one piece of work, in seconds: report the median (robust to
    the odd slow run) with the interquartile range as the spread."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def iqr(self) -> float:  # 75th minus 25th percentile
        if len(self.times) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return q3 - q1

    def __str__(self) -> str:
        iqr = format_seconds(self.iqr)
        return f"median {format_seconds(self.median)} (IQR {iqr}, {len(self.times)} runs)"


def gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (10**9 bytes per second, the unit of GPU spec sheets)."""
    return nbytes / seconds / 1e9


def tflops(flops: float, seconds: float) -> float:
    """Throughput in TFLOP/s (10**12 floating-point operations per second) (chapter 6)."""
    return flops / seconds / 1e12


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain-text table, columns right-aligned; floats get 3 significant digits (chapter 2)."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"every row must be a list of {len(headers)} values, one per "
                             f"header {list(headers)}, got {row!r:.80}")

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    text = [[str(h) for h in headers]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(line[i]) for line in text) for i in range(len(headers))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def timing_device(device: DeviceLike) -> torch.device | None:
    """The device a timer waits on, checked: the CPU or a CUDA GPU (None: whatever the timed
    function uses)."""
    if device is None:
        return None
    dev = require_cuda_device(device, "timing")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot time work on a {dev.type!r} device: pass 'cpu' or a CUDA GPU")
    return dev


def synchronize(device: torch.device | None) -> None:
    """Wait until all work queued on ``device`` has finished; None waits for the current CUDA
    device (waiting for every GPU would create a CUDA context on each)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_calls(fn: Callable[[], object], device: torch.device | None, repeats: int) -> Timing:
    """``repeats`` calls of ``fn()``, each between two synchronisations of ``device``: the loop
    of :func:`time_fn`, for callers whose device is checked already (chapter 2)."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return Timing(tuple(times))


def time_fn(fn: Callable[[], object], device: DeviceLike = None, *, warmup: int = 2,
            repeats: int = 10) -> Timing:
    """Time ``fn()`` correctly: ``warmup`` untimed calls absorb one-off costs, then ``repeats``
    timed ones, each bracketed by a synchronisation of ``device`` (chapter 2)."""
    check_warmup_repeats(warmup, repeats)
    dev = timing_device(device)
    for _ in range(warmup):
        fn()
    return timed_calls(fn, dev, repeats)
