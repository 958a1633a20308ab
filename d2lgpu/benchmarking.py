"""Timing GPU work correctly, and turning times into bandwidth and FLOP rates.

CUDA runs asynchronously: a call such as ``a * b`` on GPU tensors *queues* a
kernel and returns to Python at once. A stopwatch read right after the call
measures how long it took to queue the work, not to do it. Every timer here
therefore waits for the device (``torch.cuda.synchronize``) before it starts
the clock and again before it stops it, and repeats the measurement so that a
median and a spread can be reported. :func:`time_naive` leaves out the second
wait on purpose, so that chapter 2 can show what goes wrong.

On the CPU, PyTorch ops run synchronously, so the plain wall clock
(``time.perf_counter``) is already correct and both timers agree.

The helpers further down are the measurements the course quotes: the copy
bandwidth of a device (the practical ceiling for memory-bound work), the
multiply-add benchmark of chapter 2, and host-to-device transfer rates from
pageable and pinned memory.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from d2lgpu.devices import num_gpus

__all__ = [
    "ElementwiseRow",
    "Timing",
    "TransferRow",
    "FUSED_TENSOR_PASSES",
    "MULTIPLY_ADD_HEADERS",
    "MULTIPLY_ADD_VARIANTS",
    "UNFUSED_TENSOR_PASSES",
    "benchmark_autorange",
    "compile_or_reason",
    "copy_buffer_bytes",
    "format_seconds",
    "format_table",
    "gbps",
    "last_level_cache_bytes",
    "measure_copy_bandwidth",
    "measure_host_to_device",
    "multiply_add_benchmark",
    "multiply_add_bytes",
    "multiply_add_fused",
    "multiply_add_sweep",
    "multiply_add_table",
    "multiply_add_unfused",
    "resolve_device",
    "run_multiply_add",
    "tflops",
    "time_fn",
    "time_naive",
]

DeviceLike = torch.device | str | int | None


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #


def format_seconds(seconds: float) -> str:
    """A duration with a readable unit: ``'3.20 ms'``, ``'41.0 us'``, ``'1.50 s'``."""
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    if seconds >= 1e-6:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e9:.0f} ns"


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one piece of work, in seconds.

    Report the median (robust to the odd slow run caused by another process)
    with the interquartile range as the spread; ``min`` is the best case.
    """

    times: tuple[float, ...]

    def __post_init__(self) -> None:
        times = tuple(float(t) for t in self.times)
        if not times:
            raise ValueError("a Timing needs at least one measurement; got an empty list")
        if any(not math.isfinite(t) or t < 0 for t in times):
            raise ValueError(f"times must be finite and non-negative seconds, got {times}")
        object.__setattr__(self, "times", times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def iqr(self) -> float:
        """Interquartile range (75th minus 25th percentile, linear interpolation)."""
        if len(self.times) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return q3 - q1

    def __str__(self) -> str:
        return (
            f"median {format_seconds(self.median)} "
            f"(IQR {format_seconds(self.iqr)}, {len(self.times)} runs)"
        )


def _per_second(amount: float, seconds: float, what: str) -> float:
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be a positive finite duration, got {seconds!r}")
    if not (math.isfinite(amount) and amount >= 0):
        raise ValueError(f"{what} must be a non-negative finite count, got {amount!r}")
    return amount / seconds


def gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (10**9 bytes per second, the unit of GPU spec sheets)."""
    return _per_second(nbytes, seconds, "nbytes") / 1e9


def tflops(flops: float, seconds: float) -> float:
    """Throughput in TFLOP/s (10**12 floating-point operations per second)."""
    return _per_second(flops, seconds, "flops") / 1e12


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain-text table, columns right-aligned; floats get 3 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    text = [[str(h) for h in headers]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(line[i]) for line in text) for i in range(len(headers))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Devices and synchronisation
# --------------------------------------------------------------------------- #


def resolve_device(device: DeviceLike) -> torch.device | None:
    """Turn a device spelling into a ``torch.device`` that exists here, or fail clearly.

    ``None`` stays ``None`` (meaning: whatever the timed function uses). An int
    means a CUDA GPU, as in ``tensor.to(0)``. A bare ``'cuda'`` is resolved to
    the *current* CUDA device, which is what PyTorch does with it.
    """
    if device is None:
        return None
    if isinstance(device, bool):
        raise TypeError(f"device must be a torch.device, a string or a GPU index, got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"{device!r} is not a device name PyTorch understands; "
            "use 'cpu', 'cuda', 'cuda:0' or torch.device('cuda', 0)"
        ) from err
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        count = num_gpus()
        if count == 0:
            raise RuntimeError(
                f"{dev} was asked for, but this process sees no CUDA GPU; "
                "use d2lgpu.try_gpu() to fall back to the CPU, "
                "or run `python -m d2lgpu info` to see why CUDA is missing"
            )
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= count:
            raise RuntimeError(
                f"{dev} does not exist: this process sees {count} GPU(s), numbered 0 to {count - 1}"
            )
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise RuntimeError("'mps' was asked for, but Apple's MPS backend is not available")
        return dev
    raise ValueError(
        f"cannot time work on a {dev.type!r} device: only 'cpu', 'cuda' and 'mps' are supported"
    )


def _synchronize(device: torch.device | None) -> None:
    """Wait until all work queued on ``device`` has finished.

    With ``device=None`` the current CUDA device is waited for (when CUDA has been
    used in this process): that is where the timed function's work goes unless it
    names another GPU. Waiting for every visible GPU instead would create a CUDA
    context, hundreds of MiB, on each GPU of a shared machine.
    """
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _check_counts(warmup: int, repeats: int) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int of at least 1, got {repeats!r}; try repeats=10")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int of 0 or more, got {warmup!r}; try warmup=2")


# --------------------------------------------------------------------------- #
# Timers
# --------------------------------------------------------------------------- #


def time_fn(
    fn: Callable[[], object], device: DeviceLike = None, *, warmup: int = 2, repeats: int = 10
) -> Timing:
    """Time ``fn()`` correctly: ``warmup`` untimed calls, then ``repeats`` timed ones.

    Warm-up calls absorb one-off costs (CUDA context creation, kernel selection,
    the caching allocator growing, ``torch.compile``). Each timed call is
    bracketed by a synchronisation of ``device``, so the time includes the work
    the call queued on the GPU, not just the Python call that queued it. On the
    CPU this is the plain wall clock. ``device=None`` waits for the current GPU
    (when CUDA is in use): pass the device when ``fn`` works on another one.
    """
    _check_counts(warmup, repeats)
    dev = resolve_device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _synchronize(dev)
        start = time.perf_counter()
        fn()
        _synchronize(dev)
        times.append(time.perf_counter() - start)
    return Timing(tuple(times))


def time_naive(
    fn: Callable[[], object], device: DeviceLike = None, *, warmup: int = 2, repeats: int = 10
) -> Timing:
    """The WRONG way to time GPU work, kept to show what goes wrong.

    Like :func:`time_fn` (the device is idle when the clock starts) but the
    clock stops as soon as ``fn()`` returns, without waiting for the GPU. For
    GPU work that is the time to *queue* the kernels, often a tiny fraction of
    the time to run them. On the CPU it agrees with :func:`time_fn`.
    """
    _check_counts(warmup, repeats)
    dev = resolve_device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _synchronize(dev)  # start from an idle device so earlier work does not leak in
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)  # no synchronisation: the mistake
    _synchronize(dev)
    return Timing(tuple(times))


def benchmark_autorange(
    fn: Callable[[], object], device: DeviceLike = None, *, min_run_time: float = 0.2
) -> Timing:
    """Time ``fn()`` with ``torch.utils.benchmark.Timer.blocked_autorange``.

    PyTorch's own timer picks how many calls to put in each block so that the
    clock's resolution does not matter, and synchronises the *current* accelerator
    around each block; so ``device`` (a GPU that ``fn`` works on) is made the
    current device while timing. ``device=None`` leaves the current device as it is.
    Each entry of the returned ``times`` is the per-call average of one block. Use
    it for very short operations; :func:`time_fn` is simpler to reason about for
    long ones.
    """
    if not (math.isfinite(min_run_time) and min_run_time > 0):
        raise ValueError(f"min_run_time must be a positive number of seconds, got {min_run_time}")
    dev = resolve_device(device)
    from torch.utils import benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    current = torch.cuda.device(dev) if dev is not None and dev.type == "cuda" else nullcontext()
    with current:
        measurement = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(tuple(measurement.times))


# --------------------------------------------------------------------------- #
# Copy bandwidth: the ceiling for memory-bound work
# --------------------------------------------------------------------------- #


_MIB = 2**20
#: Where Linux describes the caches of the first CPU (one ``index*`` folder per cache).
_CPU0_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
#: The copy buffer when the size of the last-level cache cannot be read: beyond the
#: caches of common CPUs and GPUs, yet small enough for a laptop (two are allocated).
_DEFAULT_COPY_BYTES = 256 * _MIB
#: At least this much copying in one CUDA-event timing. A timing pays a fixed 10-20 us
#: (recording the events, launching the first copy, the GPU waking up); spread over
#: 50 ms of work that is well under 1%, while one 256 MiB copy on an H100 or H200
#: lasts only about 150 us and would read some 10% slow.
_MIN_SECONDS_PER_TIMING = 0.05
_MAX_COPIES_PER_TIMING = 10_000


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _parse_cache_size(text: str) -> int:
    """sysfs spells sizes "32K", "1024K", "32M" (binary units) or plain bytes."""
    text = text.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def _count_cpus(cpu_list: str) -> int:
    """How many CPUs a list such as "0-7,64-71" names."""
    count = 0
    for part in cpu_list.strip().split(","):
        first, _, last = part.partition("-")
        count += int(last) - int(first) + 1 if last else 1
    return count


def last_level_cache_bytes() -> tuple[int, str] | None:
    """The last-level CPU cache that this process's threads can fill, and where it was read.

    On Linux: the highest-level data cache of CPU 0 in sysfs, times the number of such
    caches that the CPUs this process may use spread over (a CPU with several core
    complexes has one L3 per complex). Elsewhere: ``os.sysconf`` where it knows the
    L3 (or L2) size. None when neither says.
    """
    best: tuple[int, int, int] | None = None  # (level, bytes, CPUs sharing it)
    for index in sorted(_CPU0_CACHE_DIR.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _parse_cache_size((index / "size").read_text())
            shared = index / "shared_cpu_list"
            sharing = _count_cpus(shared.read_text()) if shared.exists() else 1
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and (best is None or level > best[0]):
            best = (level, size, sharing)
    if best is not None:
        level, size, sharing = best
        instances = math.ceil(_usable_cpus() / sharing)
        return size * instances, (
            f"level-{level} cache ({instances} x {size / _MIB:g} MiB, from {_CPU0_CACHE_DIR})"
        )
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError, AttributeError):  # unknown name, or no sysconf
            continue
        if size > 0:
            return size, f"os.sysconf('{name}')"
    return None


def copy_buffer_bytes(device: DeviceLike) -> tuple[int, str]:
    """The buffer size :func:`measure_copy_bandwidth` uses on ``device``, and why.

    The copy must stream from memory, not from a cache, so each of its two buffers
    is at least twice the last-level cache (together four times it): on the CPU
    :func:`last_level_cache_bytes`, at least 64 MiB, and 256 MiB when the cache size
    is unknown; on a GPU its L2 cache, at least 256 MiB.
    """
    dev = resolve_device(device)
    if dev is None:
        raise ValueError("copy_buffer_bytes needs a device, e.g. 'cpu' or 'cuda:0'")
    if dev.type == "cpu":
        cache = last_level_cache_bytes()
        if cache is None:
            return _DEFAULT_COPY_BYTES, (
                f"{_DEFAULT_COPY_BYTES // _MIB} MiB: the size of this CPU's last-level cache "
                "is unknown, so a size beyond the caches of common CPUs"
            )
        size, where = cache
        nbytes = max(64 * _MIB, math.ceil(2 * size / _MIB) * _MIB)
        return nbytes, f"{nbytes // _MIB} MiB: at least twice the {size / _MIB:g} MiB {where}"
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) if (
        dev.type == "cuda") else 0
    nbytes = max(_DEFAULT_COPY_BYTES, math.ceil(2 * l2 / _MIB) * _MIB)
    return nbytes, f"{nbytes // _MIB} MiB: at least twice the {l2 / _MIB:g} MiB L2 cache"


def _copies_per_timing(seconds_per_copy: float) -> int:
    """Back-to-back copies in one timing so that it holds at least 50 ms of work."""
    if not (math.isfinite(seconds_per_copy) and seconds_per_copy > 0):
        return _MAX_COPIES_PER_TIMING
    copies = math.ceil(_MIN_SECONDS_PER_TIMING / seconds_per_copy)
    return max(1, min(_MAX_COPIES_PER_TIMING, copies))


def _cuda_seconds_per_copy(
    dst: torch.Tensor, src: torch.Tensor, device: torch.device, warmup: int, repeats: int
) -> float:
    """Best time of one ``dst.copy_(src)`` on a GPU, from CUDA events around many copies."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def timed(copies: int) -> float:
        start.record()
        for _ in range(copies):
            dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / copies  # elapsed_time is in ms

    with torch.cuda.device(device):  # the events record on this GPU's current stream
        for _ in range(warmup):
            dst.copy_(src)
        copies = _copies_per_timing(timed(1))
        return min(timed(copies) for _ in range(repeats))


def measure_copy_bandwidth(
    device: DeviceLike, nbytes: int | None = None, *, warmup: int = 2, repeats: int = 10
) -> float:
    """Measured peak copy bandwidth of ``device``'s memory, in GB/s.

    Copies a buffer of ``nbytes`` bytes into another buffer on the same device
    (``dst.copy_(src)``) and counts the bytes read *plus* the bytes written,
    ``2 * nbytes`` per copy, because both cross the memory bus. The best of
    ``repeats`` timings is used: this is the practical ceiling that memory-bound
    kernels are compared with (spec-sheet numbers are never reached).

    On a GPU each timing is a pair of CUDA events around enough back-to-back copies
    to last 50 ms, so that launch and wake-up costs vanish (one copy of 256 MiB on
    an H100 takes about 150 us). On the CPU the wall clock times one copy. ``nbytes``
    defaults to :func:`copy_buffer_bytes`, well beyond the last-level cache, so that
    memory and not cache is measured.
    """
    dev = resolve_device(device)
    if dev is None:
        raise ValueError("measure_copy_bandwidth needs a device, e.g. 'cpu' or 'cuda:0'")
    if nbytes is None:
        nbytes, _ = copy_buffer_bytes(dev)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"nbytes must be an int of at least 4 bytes, got {nbytes!r}")
    _check_counts(warmup, repeats)
    numel = nbytes // 4
    src = torch.ones(numel, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    if dev.type == "cuda":
        seconds = _cuda_seconds_per_copy(dst, src, dev, warmup, repeats)
    else:
        seconds = time_fn(lambda: dst.copy_(src), dev, warmup=warmup, repeats=repeats).min
    return gbps(2 * numel * 4, seconds)


# --------------------------------------------------------------------------- #
# The multiply-add benchmark of chapter 2
# --------------------------------------------------------------------------- #

# Tensor-sized memory passes per step of `result = result + a * b`:
# a * b reads 2 and writes 1 temporary, then + reads 2 and writes 1.
UNFUSED_TENSOR_PASSES = 6
# A fused kernel (result.addcmul_(a, b), or torch.compile) reads 3 and writes 1.
FUSED_TENSOR_PASSES = 4

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def multiply_add_unfused(result: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One step ``result + a * b`` as written: two kernels and a temporary."""
    return result + a * b


def multiply_add_fused(result: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same step as one in-place kernel, ``result += a * b`` (``addcmul_``)."""
    return result.addcmul_(a, b)


def run_multiply_add(step: StepFn, a: torch.Tensor, b: torch.Tensor, steps: int) -> torch.Tensor:
    """Start from zeros and apply ``result = step(result, a, b)`` ``steps`` times."""
    result = torch.zeros_like(a)
    for _ in range(steps):
        result = step(result, a, b)
    return result


def multiply_add_bytes(numel: int, element_size: int, steps: int, tensor_passes: int) -> int:
    """Bytes moved by ``steps`` multiply-add steps over tensors of ``numel`` elements."""
    return tensor_passes * numel * element_size * steps


@dataclass(frozen=True)
class ElementwiseRow:
    """One point of the multiply-add benchmark."""

    device: str
    variant: str
    numel: int
    steps: int
    seconds: float  # median time of the whole loop of `steps` steps
    gbps: float  # achieved bandwidth, counting tensor_passes tensor-sizes per step
    share_of_copy_peak: float  # gbps / measured copy bandwidth of the device


def multiply_add_benchmark(
    device: DeviceLike,
    numel: int,
    *,
    steps: int,
    step: StepFn,
    tensor_passes: int,
    copy_gbps: float,
    variant: str,
    warmup: int = 1,
    repeats: int = 5,
    seed: int = 0,
) -> ElementwiseRow:
    """Time ``steps`` multiply-add steps on float32 tensors of ``numel`` elements.

    The tensors are created directly on ``device`` (no copy), the loop is
    timed with :func:`time_fn`, and the achieved bandwidth is reported with
    ``tensor_passes`` tensor-sized reads and writes per step (6 unfused, 4
    fused) as a share of ``copy_gbps``, the device's measured copy bandwidth.
    """
    dev = resolve_device(device)
    if dev is None:
        raise ValueError("multiply_add_benchmark needs a device, e.g. 'cpu' or 'cuda:0'")
    if numel < 1 or steps < 1:
        raise ValueError(f"numel and steps must be at least 1, got numel={numel}, steps={steps}")
    if not copy_gbps > 0:
        raise ValueError(
            f"copy_gbps must be positive (measure it with measure_copy_bandwidth), got {copy_gbps}"
        )
    generator = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(numel, device=dev, generator=generator)
    b = torch.randn(numel, device=dev, generator=generator)
    timing = time_fn(
        lambda: run_multiply_add(step, a, b, steps), dev, warmup=warmup, repeats=repeats
    )
    moved = multiply_add_bytes(numel, a.element_size(), steps, tensor_passes)
    achieved = gbps(moved, timing.median)
    return ElementwiseRow(
        device=str(dev),
        variant=variant,
        numel=numel,
        steps=steps,
        seconds=timing.median,
        gbps=achieved,
        share_of_copy_peak=achieved / copy_gbps,
    )


# name -> (step function, tensor-sized memory passes per step)
MULTIPLY_ADD_VARIANTS: dict[str, tuple[StepFn, int]] = {
    "unfused": (multiply_add_unfused, UNFUSED_TENSOR_PASSES),
    "fused": (multiply_add_fused, FUSED_TENSOR_PASSES),
}


def multiply_add_sweep(
    devices: Sequence[DeviceLike],
    sizes: Sequence[int],
    *,
    steps: int,
    copy_gbps: Mapping[str, float],
    variants: Mapping[str, tuple[StepFn, int]] = MULTIPLY_ADD_VARIANTS,
    warmup: int = 1,
    repeats: int = 5,
) -> list[ElementwiseRow]:
    """:func:`multiply_add_benchmark` for every device, size and variant.

    ``copy_gbps`` maps ``str(device)`` (e.g. ``'cpu'``, ``'cuda:0'``) to the
    device's measured copy bandwidth; ``variants`` maps a name to a step
    function and its tensor passes (default: unfused and fused).
    """
    rows = []
    for device in devices:
        dev = resolve_device(device)
        if dev is None or str(dev) not in copy_gbps:
            raise ValueError(
                f"no copy bandwidth for {dev}; measure it with measure_copy_bandwidth({dev!r}) "
                f"and pass copy_gbps={{'{dev}': ...}}"
            )
        for numel in sizes:
            for name, (step, passes) in variants.items():
                rows.append(
                    multiply_add_benchmark(
                        dev,
                        numel,
                        steps=steps,
                        step=step,
                        tensor_passes=passes,
                        copy_gbps=copy_gbps[str(dev)],
                        variant=name,
                        warmup=warmup,
                        repeats=repeats,
                    )
                )
    return rows


MULTIPLY_ADD_HEADERS = (
    "floats",
    "variant",
    "device",
    "ms",
    "speed-up vs cpu",
    "GB/s",
    "% of copy peak",
)


def multiply_add_table(rows: Sequence[ElementwiseRow]) -> list[list[Any]]:
    """Table rows for :data:`MULTIPLY_ADD_HEADERS`, sorted by size, variant and device.

    The speed-up divides the CPU time of the same size and variant by the
    row's time ("-" when the sweep has no CPU row to compare with).
    """
    cpu_seconds = {(r.numel, r.variant): r.seconds for r in rows if r.device == "cpu"}
    table = []
    for r in sorted(rows, key=lambda r: (r.numel, r.variant, r.device)):
        base = cpu_seconds.get((r.numel, r.variant))
        table.append(
            [
                r.numel,
                r.variant,
                r.device,
                r.seconds * 1e3,
                base / r.seconds if base is not None else "-",
                r.gbps,
                100 * r.share_of_copy_peak,
            ]
        )
    return table


def compile_or_reason(
    step: StepFn, device: DeviceLike, *, backend: str = "inductor"
) -> tuple[StepFn | None, str]:
    """``torch.compile(step, backend=backend)`` if it works on ``device`` here, else why not.

    Compilation is lazy, so the compiled function is run once on a small input
    and checked against the eager one; any failure (no C++ compiler for the
    CPU backend, no Triton for the GPU one, an unsupported Python) is turned
    into a one-line reason for the notebook to print instead of an error.
    """
    dev = resolve_device(device)
    try:
        compiled = torch.compile(step, backend=backend)
        a = torch.randn(1024, device=dev)
        b = torch.randn(1024, device=dev)
        got = compiled(torch.zeros_like(a), a, b)
        expected = step(torch.zeros_like(a), a, b)
        if not torch.allclose(got, expected):
            return None, "torch.compile ran but its result differs from eager mode"
    except Exception as err:  # any failure means "not usable here"; the reason is shown
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return None, f"torch.compile is not usable here: {type(err).__name__}: {first_line}"
    return compiled, f"torch.compile (backend={backend!r}) works here"


# --------------------------------------------------------------------------- #
# Host-to-device transfers
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class TransferRow:
    """Host-to-device copy of ``nbytes`` bytes from pageable and from pinned memory."""

    nbytes: int
    pageable_gbps: float
    pinned_gbps: float
    pinned_seconds: float  # median time until a pinned copy has finished
    non_blocking_call_seconds: float  # median time until .to(non_blocking=True) returned


def measure_host_to_device(
    device: DeviceLike, sizes: Sequence[int], *, warmup: int = 2, repeats: int = 10
) -> list[TransferRow]:
    """Host-to-device bandwidth for each byte count in ``sizes``.

    Pageable memory is ordinary host memory: the driver first copies it into
    a pinned staging buffer, then DMA-transfers it. Pinned (page-locked)
    memory is transferred directly, which is faster, and only from pinned
    memory does ``non_blocking=True`` return before the copy is done (the
    last column: the host is free to queue more work meanwhile).
    """
    dev = resolve_device(device)
    if dev is None or dev.type != "cuda":
        raise RuntimeError(
            f"host-to-device transfers are measured on a CUDA GPU, got {dev}; "
            "there is no host-to-device link to measure on the CPU"
        )
    rows = []
    for nbytes in sizes:
        if nbytes < 1:
            raise ValueError(f"sizes must be positive byte counts, got {nbytes}")
        pageable = torch.ones(nbytes, dtype=torch.uint8)
        pinned = pageable.pin_memory()
        pageable_t = time_fn(partial(pageable.to, dev), dev, warmup=warmup, repeats=repeats)
        pinned_t = time_fn(partial(pinned.to, dev), dev, warmup=warmup, repeats=repeats)
        call_t = time_naive(
            partial(pinned.to, dev, non_blocking=True), dev, warmup=warmup, repeats=repeats
        )
        rows.append(
            TransferRow(
                nbytes=nbytes,
                pageable_gbps=gbps(nbytes, pageable_t.median),
                pinned_gbps=gbps(nbytes, pinned_t.median),
                pinned_seconds=pinned_t.median,
                non_blocking_call_seconds=call_t.median,
            )
        )
    return rows
