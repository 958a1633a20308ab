"""Chapter 2's measurements: the wrong timer and PyTorch's own, and the bandwidths they read.

The course's timer, :func:`d2lgpu.timing.time_fn` (with :class:`~d2lgpu.timing.Timing`),
waits for the device before it starts the clock and again before it stops it.
:func:`time_naive` leaves out the second wait on purpose, so that chapter 2 can
show what goes wrong; :func:`benchmark_autorange` is ``torch.utils.benchmark``'s
timer, and :func:`compare_timers` sets the three side by side. On the CPU,
PyTorch ops run synchronously, so the plain wall clock (``time.perf_counter``)
is already correct and the timers agree.

The helpers further down are the measurements the course quotes: the copy
bandwidth of a device (the practical ceiling for memory-bound work), the
multiply-add benchmark of chapter 2, and host-to-device transfer rates from
pageable and pinned memory.
"""

from __future__ import annotations

import math
import os
import time
import timeit
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from numbers import Real
from pathlib import Path
from typing import Any

import torch

from d2lgpu.checks import (
    check_callable,
    check_positive_float,
    check_positive_int,
    check_sequence,
    check_warmup_repeats,
)
from d2lgpu.timing import (
    DeviceLike,
    Timing,
    format_seconds,
    gbps,
    synchronize,
    time_fn,
    timing_device,
)

__all__ = [
    "ElementwiseRow",
    "TransferRow",
    "FUSED_TENSOR_PASSES",
    "MULTIPLY_ADD_HEADERS",
    "MULTIPLY_ADD_VARIANTS",
    "UNFUSED_TENSOR_PASSES",
    "benchmark_autorange",
    "compile_on_devices",
    "compile_or_reason",
    "copy_peak_ceiling",
    "cpu_writes_allocate",
    "copy_buffer_bytes",
    "device_cache_bytes",
    "is_compiled",
    "last_level_cache_bytes",
    "measure_copy_bandwidth",
    "measure_host_to_device",
    "multiply_add_benchmark",
    "multiply_add_bytes",
    "multiply_add_fused",
    "multiply_add_sweep",
    "multiply_add_table",
    "multiply_add_unfused",
    "run_multiply_add",
    "time_naive",
]

def _check_mapping(name: str, value: object, example: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, e.g. {example}, got {type(value).__name__} "
                        f"{value!r:.60}")
    return value


# --------------------------------------------------------------------------- #
# Timers
# --------------------------------------------------------------------------- #


def time_naive(
    fn: Callable[[], object], device: DeviceLike = None, *, warmup: int = 2, repeats: int = 10
) -> Timing:
    """The WRONG way to time GPU work, kept to show what goes wrong.

    Like :func:`time_fn` (the device is idle when the clock starts) but the
    clock stops as soon as ``fn()`` returns, without waiting for the GPU. For
    GPU work that is the time to *queue* the kernels, often a tiny fraction of
    the time to run them. On the CPU it agrees with :func:`time_fn`.
    """
    check_callable("fn", fn, example="lambda: a * b")
    check_warmup_repeats(warmup, repeats)
    dev = timing_device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(dev)  # start from an idle device so earlier work does not leak in
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)  # no synchronisation: the mistake
    synchronize(dev)
    return Timing(tuple(times))


def benchmark_autorange(
    fn: Callable[[], object], device: DeviceLike = None, *, min_run_time: float = 0.2
) -> Timing:
    """Time ``fn()`` with ``torch.utils.benchmark.Timer.blocked_autorange``.

    PyTorch's own timer picks how many calls to put in each block so that the
    clock's resolution does not matter. Its clock waits for the GPU around each
    block: ``device`` (a GPU that ``fn`` works on) is the one waited for, made the
    current device while timing; ``device=None`` waits for the current GPU when
    CUDA is usable now, and for nothing on a machine without one. (torch's default
    clock decides once, when ``torch.utils.benchmark`` is first imported, and
    older releases wait only for CUDA.) Each entry of the returned ``times`` is the
    per-call average of one block. Use it for very short operations;
    :func:`time_fn` is simpler to reason about for long ones.
    """
    check_callable("fn", fn, example="lambda: a * b")
    check_positive_float("min_run_time", min_run_time)
    dev = timing_device(device)
    from torch.utils import benchmark

    on_gpu = dev.type == "cuda" if dev is not None else torch.cuda.is_available()

    def clock() -> float:
        if on_gpu:
            torch.cuda.synchronize()  # the current device, which ``current`` sets
        return timeit.default_timer()

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, timer=clock)
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
    dev = timing_device(device)
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
    dev = timing_device(device)
    if dev is None:
        raise ValueError("measure_copy_bandwidth needs a device, e.g. 'cpu' or 'cuda:0'")
    if nbytes is None:
        nbytes, _ = copy_buffer_bytes(dev)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"nbytes must be an int of at least 4 bytes, got {nbytes!r}")
    check_warmup_repeats(warmup, repeats)
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
    check_callable("step", step, example="d2lgpu.benchmarking.multiply_add_fused")
    check_positive_int("steps", steps)
    result = torch.zeros_like(a)
    for _ in range(steps):
        result = step(result, a, b)
    return result


def multiply_add_bytes(numel: int, element_size: int, steps: int, tensor_passes: int) -> int:
    """Bytes moved by ``steps`` multiply-add steps over tensors of ``numel`` elements."""
    for name, value in (("numel", numel), ("element_size", element_size), ("steps", steps),
                        ("tensor_passes", tensor_passes)):
        check_positive_int(name, value)
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
    dev = timing_device(device)
    if dev is None:
        raise ValueError("multiply_add_benchmark needs a device, e.g. 'cpu' or 'cuda:0'")
    check_positive_int("numel", numel)
    check_positive_int("steps", steps)
    check_positive_int("tensor_passes", tensor_passes)
    check_callable("step", step, example="d2lgpu.benchmarking.multiply_add_fused")
    if isinstance(copy_gbps, bool) or not isinstance(copy_gbps, Real) or not (
            math.isfinite(copy_gbps) and copy_gbps > 0):
        raise ValueError(
            "copy_gbps must be positive (measure it with measure_copy_bandwidth), got "
            f"{copy_gbps!r}"
        )
    generator = torch.Generator(device=dev).manual_seed(seed)
    a = torch.randn(numel, device=dev, generator=generator)
    b = torch.randn(numel, device=dev, generator=generator)
    try:
        timing = time_fn(
            lambda: run_multiply_add(step, a, b, steps), dev, warmup=warmup, repeats=repeats
        )
    except Exception as err:
        if not is_compiled(step):
            raise
        # compile_or_reason compiles with fullgraph=True: where dynamo would fall back to
        # eager mode without a word (a graph break, or its recompile limit hit), it raises.
        detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise RuntimeError(
            f"the compiled {variant!r} step did not run compiled on {dev} at {numel:,} floats "
            f"({type(err).__name__}: {detail})"
            "; without fullgraph=True torch would have run it eagerly and this row would have "
            "timed eager code under a compiled label. Call torch._dynamo.reset() before "
            "timing each device (multiply_add_sweep does), or drop the compiled variant."
        ) from err
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

    A compiled step (from :func:`compile_or_reason`) shares one code object across
    devices, and dynamo guards on the device: with the CPU and several GPUs it would
    pass its recompile limit (8) and quietly run eagerly from the fifth GPU or so.
    So dynamo's caches are reset before each device's rows, and each device compiles
    afresh (in the untimed warm-up); a step that still cannot run compiled raises.
    """
    devices = check_sequence("devices", devices, of="devices, e.g. ['cpu', 'cuda:0']",
                             allow_empty=True)
    sizes = check_sequence("sizes", sizes, of="sizes, e.g. [2**10, 2**20]", allow_empty=True)
    _check_mapping("copy_gbps", copy_gbps, "{'cpu': measure_copy_bandwidth('cpu')}")
    _check_mapping("variants", variants, "MULTIPLY_ADD_VARIANTS")
    for name, variant in variants.items():
        if not (isinstance(variant, tuple) and len(variant) == 2 and callable(variant[0])):
            raise TypeError(f"variants[{name!r}] must be (step function, tensor passes), "
                            f"got {variant!r:.80}")
    compiled = any(is_compiled(step) for step, _ in variants.values())
    rows = []
    for device in devices:
        dev = timing_device(device)
        if dev is None or str(dev) not in copy_gbps:
            raise ValueError(
                f"no copy bandwidth for {dev}; measure it with measure_copy_bandwidth({dev!r}) "
                f"and pass copy_gbps={{'{dev}': ...}}"
            )
        if compiled:
            _reset_dynamo()  # a fresh cache, and a fresh recompile budget, per device
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


def _check_rows(rows: object, what: str) -> None:
    check_sequence("rows", rows, of="ElementwiseRow (what multiply_add_sweep returns)",
                   allow_empty=True)
    for row in rows:
        if not isinstance(row, ElementwiseRow):
            raise TypeError(f"{what} needs the ElementwiseRow list from multiply_add_sweep, "
                            f"got an item {type(row).__name__} {row!r:.60}")


def multiply_add_table(rows: Sequence[ElementwiseRow]) -> list[list[Any]]:
    """Table rows for :data:`MULTIPLY_ADD_HEADERS`, sorted by size, variant and device.

    The speed-up divides the CPU time of the same size and variant by the
    row's time ("-" when the sweep has no CPU row to compare with).
    """
    _check_rows(rows, "multiply_add_table")
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


def _reset_dynamo() -> None:
    """Forget every compiled graph (``torch._dynamo.reset()``); the next call compiles afresh."""
    import torch._dynamo  # loaded already wherever torch.compile made a step

    torch._dynamo.reset()


def is_compiled(step: object) -> bool:
    """Whether ``step`` is a function returned by ``torch.compile``."""
    return getattr(step, "_torchdynamo_orig_callable", None) is not None


def compile_or_reason(
    step: StepFn, device: DeviceLike, *, backend: str = "inductor"
) -> tuple[StepFn | None, str]:
    """``torch.compile(step, backend=backend, fullgraph=True)`` if it works on ``device``
    here, else why not.

    Compilation is lazy, so the compiled function is run once on a small input
    and checked against the eager one; any failure (no C++ compiler for the
    CPU backend, no Triton for the GPU one, an unsupported Python) is turned
    into a one-line reason for the notebook to print instead of an error.
    ``fullgraph=True`` makes a later fallback to eager mode (a graph break, or
    dynamo's recompile limit) an error instead of a silent slowdown.
    """
    check_callable("step", step, example="d2lgpu.benchmarking.multiply_add_unfused")
    dev = timing_device(device)
    try:
        compiled = torch.compile(step, backend=backend, fullgraph=True)
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


def compile_on_devices(
    step: StepFn, devices: Sequence[DeviceLike], *, backend: str = "inductor"
) -> tuple[StepFn | None, list[str]]:
    """:func:`compile_or_reason` on each device in turn, with dynamo reset before each.

    Dynamo keeps the graphs it compiles for ``step`` on its code object, one per
    device (it guards on the device), and gives up at
    ``torch._dynamo.config.recompile_limit`` (8; ``cache_size_limit`` is the old name
    of the same setting, an alias in torch 2.9 to 2.15). With ``fullgraph=True``,
    passing it raises ``FailOnRecompileLimitHit``: without a reset the CPU plus 8
    GPUs would report torch.compile as unusable on the ninth device. Returns the
    compiled function (None at the first device where it fails) and one reason per
    device tried.
    """
    check_callable("step", step, example="d2lgpu.benchmarking.multiply_add_unfused")
    devices = check_sequence("devices", devices, of="devices, e.g. ['cpu', 'cuda:0']")
    compiled: StepFn | None = None
    reasons = []
    for device in devices:
        _reset_dynamo()  # a fresh cache, and a fresh recompile budget, per device
        compiled, reason = compile_or_reason(step, device, backend=backend)
        reasons.append(f"{timing_device(device)}: {reason}")
        if compiled is None:
            break
    return compiled, reasons


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
    dev = timing_device(device)
    if dev is None or dev.type != "cuda":
        raise RuntimeError(
            f"host-to-device transfers are measured on a CUDA GPU, got {dev}; "
            "there is no host-to-device link to measure on the CPU"
        )
    sizes = check_sequence("sizes", sizes, of="sizes in bytes, e.g. [2**12, 2**20]",
                           allow_empty=True)
    rows = []
    for nbytes in sizes:
        check_positive_int("each size (bytes)", nbytes)
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


# --------------------------------------------------------------------------- #
# Reading the numbers of chapter 2: sentences that follow the measurements
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class TimerComparison:
    """The naive and the synchronised timer on the same work, measured side by side."""

    device: str
    naive: Timing
    synchronised: Timing

    @property
    def ratio(self) -> float:
        """Median naive time over median synchronised time (1 means they agree)."""
        return self.naive.median / self.synchronised.median

    def verdict(self) -> str:
        """One sentence on what the ratio means on this device, following the numbers."""
        ratio = self.ratio
        if self.device.startswith("cuda"):
            if ratio < 0.5:
                return (
                    f"{self.device}: the naive timer saw {ratio:.0%} of the real time: it "
                    "stopped when the kernels were queued, long before they were done."
                )
            return (
                f"{self.device}: the naive timer saw {ratio:.0%} of the real time: for work "
                "this small, queuing the kernels takes about as long as running them; "
                "the gap opens with larger tensors."
            )
        if 0.8 <= ratio <= 1.25:
            return (
                f"{self.device}: the two timers agree to within {abs(ratio - 1):.0%}: CPU "
                "operations are finished when the call returns, so there is nothing to wait for."
            )
        return (
            f"{self.device}: the two timers differ by a factor of {ratio:.2f}, although on the "
            "CPU both time the same finished work: other programs held the cores during some "
            "of the runs (see the spreads above), and the medians did not absorb it."
        )


def compare_timers(
    fn: Callable[[], object], device: DeviceLike, *, warmup: int = 1, repeats: int = 5
) -> TimerComparison:
    """Time ``fn()`` with :func:`time_naive` and :func:`time_fn`, alternating run by run.

    Alternating puts both timers under the same conditions: a burst of load from
    another program lands on both, not on one of them.
    """
    check_callable("fn", fn, example="lambda: a * b")
    check_warmup_repeats(warmup, repeats)
    dev = timing_device(device)
    if dev is None:
        raise ValueError("compare_timers needs a device, e.g. 'cpu' or 'cuda:0'")
    for _ in range(warmup):
        fn()
    naive, synced = [], []
    for _ in range(repeats):
        naive += time_naive(fn, dev, warmup=0, repeats=1).times
        synced += time_fn(fn, dev, warmup=0, repeats=1).times
    return TimerComparison(str(dev), Timing(tuple(naive)), Timing(tuple(synced)))


def device_cache_bytes(device: DeviceLike) -> int | None:
    """Size of the last-level cache in front of ``device``'s memory, in bytes; None if unknown.

    A CUDA GPU reports its L2 cache; for the CPU this is :func:`last_level_cache_bytes`.
    """
    dev = timing_device(device)
    if dev is not None and dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).L2_cache_size) or None
    if dev is None or dev.type != "cpu":
        return None
    found = last_level_cache_bytes()
    return None if found is None else found[0]


def _working_set_bytes(row: ElementwiseRow) -> int:
    # a, b and result stay alive across steps; unfused adds the temporary a * b
    # and the new result while the old one is still referenced. float32 throughout.
    tensors = 3 if row.variant != "unfused" else 5
    return tensors * row.numel * 4


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


#: Tensor-sized writes per step into a *fresh* tensor (not one just read): the unfused
#: step writes ``a * b`` and the new result, a compiled ``result + a * b`` its new
#: result, the in-place fused step none (``result`` was read a moment before).
FRESH_WRITES_PER_STEP = {"unfused": 2, "fused": 0, "compiled": 1}
_PASSES = {"unfused": UNFUSED_TENSOR_PASSES, "fused": FUSED_TENSOR_PASSES,
           "compiled": FUSED_TENSOR_PASSES}


def cpu_writes_allocate() -> bool:
    """Whether this CPU's caches read a line before writing it (x86: yes, for ordinary stores)."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def copy_peak_ceiling(device: str, variant: str) -> float:
    """The highest share of the measured copy bandwidth that ``variant`` can reach on ``device``.

    1 on a GPU. On an x86 CPU a store to a line that is not in the cache first reads
    that line (write-allocate), so ``dst.copy_(src)`` moves 3 tensor sizes while the
    copy bandwidth counts 2: the bus really carries 1.5x the figure. A step that
    counts ``P`` passes and writes ``W`` of them into fresh memory moves ``P + W``, so
    it can reach ``1.5 * P / (P + W)`` of the copy figure: 150 % in place (fused),
    112.5 % unfused, 120 % for a compiled out-of-place step. Unknown variants get 1.
    """
    for name, value in (("device", device), ("variant", variant)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string such as 'cpu' or 'fused', "
                            f"got {type(value).__name__} {value!r}")
    if device != "cpu" or not cpu_writes_allocate() or variant not in FRESH_WRITES_PER_STEP:
        return 1.0
    passes = _PASSES[variant]
    return 1.5 * passes / (passes + FRESH_WRITES_PER_STEP[variant])


def _beating_the_copy(
    dev: str, above: Sequence[ElementwiseRow], total: int, copy: float, cache: int | None
) -> list[str]:
    """Sentences on the rows of one device that beat its copy bandwidth."""
    best = max(above, key=lambda r: r.share_of_copy_peak)
    head = (
        f"{dev}: {len(above)} of {total} rows beat the copy bandwidth of {copy:.3g} GB/s "
        f"(up to {100 * best.share_of_copy_peak:.0f} % at {best.numel:,} floats)"
    )
    if cache is None:
        largest = max(_working_set_bytes(r) for r in above)
        return [
            f"{head}. Their tensors take at most {_mib(largest)}: rows whose tensors fit in "
            "the caches can do that, because caches are faster than memory and the copy was "
            "measured on buffers larger than them. The size of the cache is unknown here, so "
            "which rows fit is left open."
        ]
    fits = [r for r in above if _working_set_bytes(r) <= cache]
    spills = [r for r in above if _working_set_bytes(r) > cache]
    allocating = [r for r in spills
                  if r.share_of_copy_peak <= copy_peak_ceiling(dev, r.variant)]
    disturbed = [r for r in spills if r not in allocating]
    findings = []
    if fits:
        which = "All of them keep" if not spills else f"{len(fits)} of them keep"
        findings.append(
            f"{head}. {which} their tensors (at most "
            f"{_mib(max(_working_set_bytes(r) for r in fits))}) within the {_mib(cache)} "
            "cache, which is faster than memory; the copy was measured on buffers larger "
            "than the cache."
        )
    lead = head if not fits else dev + ":"
    if allocating:
        sizes = ", ".join(
            f"{r.numel:,} floats {r.variant} at {100 * r.share_of_copy_peak:.0f} % (ceiling "
            f"{100 * copy_peak_ceiling(dev, r.variant):.1f} %)" for r in allocating)
        findings.append(
            f"{lead} {len(allocating)} of them ({sizes}) do so with tensors larger than the "
            f"{_mib(cache)} cache, and that is no error: this CPU reads each cache line before "
            "it writes it (write-allocate), so the copy moves 3 tensor sizes but is counted "
            "as 2, and work that writes fewer fresh tensors can get above its figure, up to "
            "the ceiling in brackets. The copy bandwidth is no hard ceiling on a CPU."
        )
        lead = dev + ":"
    if disturbed:
        sizes = ", ".join(f"{r.numel:,} floats {r.variant}" for r in disturbed)
        limit = (" even above what write-allocate allows" if copy_peak_ceiling(
            dev, disturbed[0].variant) > 1 else "")
        findings.append(
            f"{lead} {len(disturbed)} of them ({sizes}) do so{limit} although their tensors "
            f"exceed the {_mib(cache)} cache: memory-bound work cannot do that, so other "
            "programs held the cores while the copy or these rows were timed, and those numbers "
            "are not the device's."
        )
    return findings


def _slower_than_larger(dev: str, rows: Sequence[ElementwiseRow]) -> list[str]:
    """A sentence on rows that took more than twice as long as a larger size of their variant.

    More data can never take less time on an idle device, so other programs shared the
    device while such rows ran.
    """
    odd = []
    for r in rows:
        larger = [s for s in rows if s.variant == r.variant and s.numel > r.numel]
        faster = min(larger, key=lambda s: s.seconds, default=None)
        if faster is not None and 2 * faster.seconds < r.seconds:
            odd.append((r, faster))
    if not odd:
        return []
    r, faster = max(odd, key=lambda pair: pair[0].seconds / pair[1].seconds)
    return [
        f"{dev}: {len(odd)} row(s) took more than twice as long as a larger size of the same "
        f"variant (e.g. {r.numel:,} floats {r.variant}: {format_seconds(r.seconds)}, against "
        f"{format_seconds(faster.seconds)} for {faster.numel:,}). More data cannot take less "
        "time, so other programs were competing for the device while those rows ran (on a "
        "CPU, an operation split over all cores waits for the slowest one), and those rows "
        "are not the device's times."
    ]


def multiply_add_findings(
    rows: Sequence[ElementwiseRow],
    copy_gbps: Mapping[str, float],
    cache_bytes: Mapping[str, int | None] | None = None,
) -> list[str]:
    """What the multiply-add sweep shows, as sentences that follow its numbers.

    Per device: which rows beat the copy bandwidth and why (tensors that fit in
    the cache can; on an x86 CPU larger ones can too, up to
    :func:`copy_peak_ceiling`, because of write-allocate; beyond it a row points at
    a measurement that other programs shared), how close the
    largest size comes to it, and how fused compares with unfused there against
    the 1.5x that the bytes predict. Across devices: each GPU's speed-up over the
    CPU at the largest size, next to the ratio of their copy bandwidths.
    ``cache_bytes`` maps ``str(device)`` to its last-level cache size (see
    :func:`device_cache_bytes`); missing or None means unknown.
    """
    _check_rows(rows, "multiply_add_findings")
    if not rows:
        raise ValueError("no rows: run multiply_add_sweep first")
    _check_mapping("copy_gbps", copy_gbps, "{'cpu': measure_copy_bandwidth('cpu')}")
    missing = sorted({r.device for r in rows} - set(copy_gbps))
    if missing:
        raise ValueError(f"copy_gbps has no bandwidth for {missing}; pass the copy_gbps that "
                         "the sweep was run with")
    cache_bytes = {} if cache_bytes is None else cache_bytes
    _check_mapping("cache_bytes", cache_bytes, "{'cpu': device_cache_bytes('cpu')}")
    findings = []
    devices = list(dict.fromkeys(r.device for r in rows))
    for dev in devices:
        mine = [r for r in rows if r.device == dev]
        above = [r for r in mine if r.share_of_copy_peak > 1.0]
        if above:
            findings += _beating_the_copy(dev, above, len(mine), copy_gbps[dev],
                                          cache_bytes.get(dev))
        else:
            findings.append(
                f"{dev}: no row beats the copy bandwidth of {copy_gbps[dev]:.3g} GB/s, as "
                "memory-bound work should not."
            )
        findings += _slower_than_larger(dev, mine)
        largest = max(r.numel for r in mine)
        at_largest = {r.variant: r for r in mine if r.numel == largest}
        shares = ", ".join(
            f"{name} {100 * r.share_of_copy_peak:.0f} %" for name, r in at_largest.items()
        )
        findings.append(f"{dev}: at {largest:,} floats, {shares} of the copy bandwidth.")
        if "fused" in at_largest and "unfused" in at_largest:
            gain = at_largest["unfused"].seconds / at_largest["fused"].seconds
            expected = UNFUSED_TENSOR_PASSES / FUSED_TENSOR_PASSES
            if gain > 1.2 * expected:
                why = (
                    f"more than the {expected:.1f}x that the bytes explain: the unfused step "
                    "also allocates two new tensors every step (a * b and the new result), "
                    "and that costs time on top of the traffic"
                )
            elif gain >= 0.8 * expected:
                why = f"close to the {expected:.1f}x fewer bytes it moves"
            else:
                why = (
                    f"less than the {expected:.1f}x fewer bytes it moves: something other than "
                    "memory traffic limits this size here (per-operation overheads, or other "
                    "programs sharing the device)"
                )
            findings.append(f"{dev}: fused is {gain:.2f}x as fast as unfused there, {why}.")
    cpu_rows = {(r.numel, r.variant): r for r in rows if r.device == "cpu"}
    gpus = [d for d in devices if d != "cpu"]
    if not gpus:
        findings.append(
            "Only the CPU ran, so the table's speed-up over the CPU is 1 throughout; "
            "on a machine with a GPU each GPU gets its own rows."
        )
    for dev in gpus:
        largest = max(r.numel for r in rows if r.device == dev)
        fused = next(
            (r for r in rows if r.device == dev and r.numel == largest and r.variant == "fused"),
            None,
        )
        base = cpu_rows.get((largest, "fused"))
        if fused is None or base is None or "cpu" not in copy_gbps:
            continue
        findings.append(
            f"{dev}: {base.seconds / fused.seconds:.1f}x as fast as the CPU at {largest:,} "
            f"floats (fused); its copy bandwidth is {copy_gbps[dev] / copy_gbps['cpu']:.1f}x "
            "the CPU's."
        )
    return findings


def plot_multiply_add(rows: Sequence[ElementwiseRow], copy_gbps: Mapping[str, float]):
    """Two panels from the multiply-add sweep; returns the figure.

    Left: achieved GB/s against tensor size, one line per device and variant
    (distinct markers and line styles, so that no line hides another), with each
    device's copy bandwidth as a dotted line. Right: how much faster fused is than
    unfused, per device, against the 1.5x that the bytes predict.
    """
    _check_rows(rows, "plot_multiply_add")
    if not rows:
        raise ValueError("no rows to plot: run multiply_add_sweep first")
    _check_mapping("copy_gbps", copy_gbps, "{'cpu': measure_copy_bandwidth('cpu')}")
    import matplotlib.pyplot as plt  # imported here: pyplot costs a second at import

    fig, (ax_gbps, ax_gain) = plt.subplots(1, 2, figsize=(11, 3.8))
    styles = {"unfused": ("o", "-"), "fused": ("s", "--")}
    devices = list(dict.fromkeys(r.device for r in rows))
    for colour, dev in enumerate(devices):
        color = f"C{colour}"
        variants = dict.fromkeys(r.variant for r in rows if r.device == dev)
        for k, variant in enumerate(variants):
            line = sorted((r for r in rows if r.device == dev and r.variant == variant),
                          key=lambda r: r.numel)
            marker, style = styles.get(variant, ("^v<>"[k % 4], ":"))
            ax_gbps.plot([r.numel for r in line], [r.gbps for r in line], marker=marker,
                         linestyle=style, color=color, label=f"{dev} {variant}")
        if dev in copy_gbps:
            ax_gbps.axhline(copy_gbps[dev], color=color, linestyle=":", linewidth=1,
                            label=f"{dev} copy bandwidth")
        unfused = {r.numel: r.seconds for r in rows if r.device == dev and r.variant == "unfused"}
        fused = sorted((r for r in rows if r.device == dev and r.variant == "fused"),
                       key=lambda r: r.numel)
        pairs = [(r.numel, unfused[r.numel] / r.seconds) for r in fused if r.numel in unfused]
        if pairs:
            ax_gain.plot(*zip(*pairs, strict=True), marker="s", color=color, label=dev)
    ax_gain.axhline(UNFUSED_TENSOR_PASSES / FUSED_TENSOR_PASSES, color="gray", linestyle="--",
                    label="bytes ratio 6/4")
    for ax, ylabel, title in [
        (ax_gbps, "GB/s achieved", "bandwidth of result = result + a * b"),
        (ax_gain, "unfused time / fused time", "what fusing buys"),
    ]:
        ax.set_xscale("log")
        ax.set_xlabel("floats per tensor")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    ax_gbps.set_yscale("log")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- #
# The fusion study: counted bytes, interleaved timings, verdicts from the numbers
# --------------------------------------------------------------------------- #


#: Operators that write their first argument without reading it first.
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_"}


@dataclass(frozen=True)
class Traffic:
    """What a piece of PyTorch code asks of memory, counted from its operators' arguments.

    ``read`` and ``written`` are bytes; ``fresh`` is how many result tensors were
    newly allocated; ``ops`` how many aten operators ran. This is a count, the same
    on every machine, not a measurement: caches, write-allocate reads and page
    faults are what the timings add on top of it.
    """

    read: int
    written: int
    fresh: int
    ops: int

    @property
    def moved(self) -> int:
        """Bytes read plus bytes written."""
        return self.read + self.written


def count_traffic(fn: Callable[[], object]) -> Traffic:
    """Run ``fn()`` once and count the bytes its aten operators read and write.

    Every operator is intercepted (``TorchDispatchMode``): a tensor argument it
    only reads counts as read, one it writes in place (``add_``'s self) as read
    and written, an ``out=`` argument or ``copy_``'s destination as written only,
    and a result that is a new tensor as written and allocated (``fresh``).
    Views cost nothing: an operator whose result shares its input's memory
    (``view``, ``reshape`` of a contiguous tensor) counts no bytes.
    """
    check_callable("fn", fn, example="lambda: a * b")
    from torch.utils._python_dispatch import TorchDispatchMode

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    totals = {"read": 0, "written": 0, "fresh": 0, "ops": 0}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            totals["ops"] += 1
            schema = func._schema
            name = schema.name.split("::")[-1]
            inputs: list[torch.Tensor] = []
            written: list[torch.Tensor] = []
            values = list(args) + [kwargs[a.name] for a in schema.arguments[len(args):]
                                   if a.name in kwargs]
            for argument, value in zip(schema.arguments, values, strict=False):
                if not isinstance(value, torch.Tensor):
                    continue
                if argument.alias_info is not None and argument.alias_info.is_write:
                    written.append(value)
                    if not (argument.kwarg_only or (argument.name == "self"
                                                    and name in _WRITE_ONLY_SELF)):
                        inputs.append(value)  # in place: read, then written
                elif not name.endswith("_like"):  # zeros_like(a) reads only a's shape
                    inputs.append(value)
            known = {t.untyped_storage().data_ptr() for t in inputs + written}
            results = out if isinstance(out, (tuple, list)) else [out]
            for t in results:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                    written.append(t)
                    totals["fresh"] += 1
            if not written:
                return out  # a view of an input: no bytes move
            totals["read"] += sum(nbytes(t) for t in inputs)
            totals["written"] += sum(nbytes(t) for t in written)
            return out

    with Counter():
        fn()
    return Traffic(**totals)


def fusion_study_loops(
    a: torch.Tensor, b: torch.Tensor, steps: int
) -> dict[str, Callable[[], torch.Tensor]]:
    """The five loops of the fusion study, each ``steps`` steps on ``a`` and ``b``.

    Two yardsticks and three ways to write ``result += a * b``:

    * ``copy``: ``dst.copy_(a)``, the classic bandwidth test (2 tensor-sizes counted);
    * ``in-place add``: ``dst.add_(a)``, which writes only memory it has just read (3);
    * ``fused``: ``result.addcmul_(a, b)``, one kernel (4);
    * ``in-place unfused``: ``torch.mul(a, b, out=scratch)`` then ``result.add_(scratch)``,
      two kernels into memory allocated once (6);
    * ``unfused``: ``result = result + a * b``, two kernels and two new tensors per step (6).

    The buffers are allocated here, once; only ``unfused`` allocates while it runs.
    ``fused``, ``in-place unfused`` and ``unfused`` share ``result`` (the timings do not
    care what it holds): to check what one loop computes, make fresh loops for it.
    """
    check_positive_int("steps", steps)
    dst = torch.empty_like(a)
    result = torch.zeros_like(a)
    scratch = torch.empty_like(a)

    def copy() -> torch.Tensor:
        for _ in range(steps):
            dst.copy_(a)
        return dst

    def in_place_add() -> torch.Tensor:
        for _ in range(steps):
            dst.add_(a)
        return dst

    def fused() -> torch.Tensor:
        for _ in range(steps):
            result.addcmul_(a, b)
        return result

    def in_place_unfused() -> torch.Tensor:
        for _ in range(steps):
            torch.mul(a, b, out=scratch)
            result.add_(scratch)
        return result

    def unfused() -> torch.Tensor:
        fresh = result  # starts from the kept buffer: the loop allocates only in its steps
        for _ in range(steps):
            fresh = fresh + a * b
        return fresh

    return {"copy": copy, "in-place add": in_place_add, "fused": fused,
            "in-place unfused": in_place_unfused, "unfused": unfused}


def _minor_page_faults() -> int | None:
    """Minor page faults of this process so far (Linux, macOS); None where unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclass(frozen=True)
class InterleavedTimes:
    """Timings of several loops taken in rounds: one run of each loop per round.

    ``seconds[name][i]`` is round ``i`` of loop ``name``; ``faults[name]`` the
    median minor page faults per run (None where the OS does not count them).
    """

    seconds: dict[str, tuple[float, ...]]
    faults: dict[str, float | None]

    def median(self, name: str) -> float:
        return Timing(self.seconds[name]).median

    def best(self, name: str) -> float:
        """The fastest round: other programs can only add time, so this is the least disturbed."""
        return min(self.seconds[name])

    def ratio(self, slower: str, faster: str) -> float:
        """Median over rounds of ``seconds[slower] / seconds[faster]`` within each round.

        Both runs of a round ran seconds apart, under the same load, so their ratio
        keeps little of a burst of load that a ratio of two overall medians would.
        """
        pairs = zip(self.seconds[slower], self.seconds[faster], strict=True)
        return Timing(tuple(s / f for s, f in pairs)).median


def interleaved_times(
    loops: Mapping[str, Callable[[], object]], device: DeviceLike, *, rounds: int,
    warmup: int = 1, progress: bool = False,
) -> InterleavedTimes:
    """Time every loop once per round, ``rounds`` rounds, the order rotating each round.

    Interleaving spreads a burst of load from other programs over all loops instead
    of letting it land on one; rotating the order keeps any loop from always
    running first (or right after the slowest one). Each run is timed with
    :func:`~d2lgpu.timing.time_fn` (synchronised on a GPU); minor page faults are
    counted around each run. ``progress`` shows a tqdm bar over the rounds.
    """
    _check_mapping("loops", loops, "fusion_study_loops(a, b, steps)")
    check_warmup_repeats(warmup, rounds)
    for name, fn in loops.items():
        check_callable(f"loops[{name!r}]", fn, example="lambda: a * b")
    dev = timing_device(device)
    names = list(loops)
    for _ in range(warmup):
        for name in names:
            loops[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[int]] = {name: [] for name in names}
    bar = None
    if progress:
        import warnings

        with warnings.catch_warnings():  # without ipywidgets tqdm.auto warns, then draws text
            warnings.simplefilter("ignore")
            from tqdm.auto import tqdm

        bar = tqdm(total=rounds, desc="rounds", unit="round")
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            before = _minor_page_faults()
            seconds[name] += time_fn(loops[name], dev, warmup=0, repeats=1).times
            after = _minor_page_faults()
            if before is not None and after is not None:
                faults[name].append(after - before)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return InterleavedTimes(
        {name: tuple(times) for name, times in seconds.items()},
        {name: (float(Timing(tuple(f)).median) if f else None) for name, f in faults.items()},
    )


#: In-place add over copy, in counted GB/s, from which the copy counts as short of its
#: real traffic: 1 where a copy moves the 2 tensor-sizes counted, 1.5 where its
#: destination is also read (3 real), so the threshold sits between them.
WRITE_ALLOCATE_THRESHOLD = 1.25
#: What write-allocate alone makes of that ratio: 3 real tensor-sizes for 2 counted.
WRITE_ALLOCATE_RATIO = 1.5
#: Fused beats in-place unfused by at least this share of the counted bytes ratio (1.5)
#: when memory traffic sets the time.
FUSION_SHARE_THRESHOLD = 0.8
#: Unfused over in-place unfused (same counted bytes) above which allocating costs time.
ALLOCATION_THRESHOLD = 1.25


def write_allocate_verdict(rate_ratio: float) -> str:
    """What the in-place add's counted rate over the copy's (best rounds) says about the copy."""
    check_positive_float("rate_ratio", rate_ratio)
    lead = (f"At their best rounds the in-place add streams {rate_ratio:.2f}x the counted bytes "
            "per second of the copy:")
    beyond = (
        " Write-allocate accounts for 1.5x; the rest of the gap is not bytes: the copy kernel "
        "streams its real bytes more slowly than the add on this machine."
        if rate_ratio > WRITE_ALLOCATE_RATIO * 1.1 else "")
    if rate_ratio >= WRITE_ALLOCATE_THRESHOLD:
        return (
            f"{lead} the copy moves more than its 2 counted tensor-sizes. Its destination is "
            "read before it is written (write-allocate: a store to memory that is not in the "
            "cache first fetches the line), a third tensor-size the count leaves out, while "
            "the add writes only memory it has just read. So the peak below is the in-place "
            f"add's rate, and the copy figure understates this memory.{beyond}"
        )
    return (
        f"{lead} the copy moves what it counts (stores write whole lines without reading "
        "them), and the peak below is the faster of the two."
    )


def fusion_verdict(time_ratio: float, bytes_ratio: float) -> str:
    """Whether fusing bought what the counted bytes predict."""
    check_positive_float("time_ratio", time_ratio)
    check_positive_float("bytes_ratio", bytes_ratio)
    if time_ratio >= FUSION_SHARE_THRESHOLD * bytes_ratio:
        extra = (
            " It gains more than the count because the unfused kernels write `scratch` "
            "without reading it, which on a write-allocate CPU costs a hidden read."
            if time_ratio > 1.1 * bytes_ratio else ""
        )
        return (
            f"Fusing pays: fused is {time_ratio:.2f}x as fast as the same two kernels unfused "
            f"in place, for {bytes_ratio:.2f}x fewer counted bytes. Memory traffic sets the "
            f"time of this step.{extra}"
        )
    return (
        f"Fused is only {time_ratio:.2f}x as fast as unfused in place, less than "
        f"{FUSION_SHARE_THRESHOLD:.0%} of the {bytes_ratio:.2f}x fewer bytes it moves: "
        "something other than memory traffic (launch overhead, arithmetic) sets the time here."
    )


def allocation_verdict(time_ratio: float, faults_per_step: float | None = None) -> str:
    """What allocating two fresh tensors per step costs, against the same kernels in place."""
    check_positive_float("time_ratio", time_ratio)
    faults = ("" if faults_per_step is None else
              f" The count of page faults says why: {faults_per_step:,.0f} per step, each a "
              "fresh page of memory that the operating system maps and zeroes on first touch.")
    if time_ratio >= ALLOCATION_THRESHOLD:
        return (
            f"Allocating costs: unfused takes {time_ratio:.2f}x the time of the same kernels "
            "in place, for the same counted bytes, so the difference is the two new tensors "
            f"per step.{faults}"
        )
    return (
        f"Allocating costs little here: unfused takes {time_ratio:.2f}x the time of the same "
        "kernels in place, for the same counted bytes (a caching allocator hands back memory "
        f"it already holds).{faults}"
    )


@dataclass(frozen=True)
class FusionStudy:
    """The fusion study on one device: counted traffic, interleaved times and their reading."""

    device: str
    numel: int
    steps: int
    traffic: dict[str, Traffic]  # per step
    times: InterleavedTimes  # per loop of ``steps`` steps

    def passes(self, name: str) -> float:
        """Counted tensor-sizes moved per step."""
        return self.traffic[name].moved / (self.numel * 4)

    def gbps(self, name: str) -> float:
        """Counted bytes per second, from the median time."""
        return gbps(self.traffic[name].moved * self.steps, self.times.median(name))

    @property
    def peak_gbps(self) -> float:
        """The highest counted rate measured in the study (a yardstick's, as a rule)."""
        return max(self.gbps(name) for name in self.times.seconds)

    def table(self) -> list[list[Any]]:
        rows = []
        for name in self.times.seconds:
            faults = self.times.faults[name]
            rows.append([
                name, f"{self.passes(name):g}", self.traffic[name].fresh,
                self.times.median(name) / self.steps * 1e3, self.gbps(name),
                f"{100 * self.gbps(name) / self.peak_gbps:.0f} %",
                "-" if faults is None else f"{faults / self.steps:,.0f}",
            ])
        return rows

    def verdicts(self) -> list[str]:
        # The yardsticks are compared at their best rounds, as peak bandwidths are: the
        # expected gap (1.5x or none) is smaller than a single round's swing under load.
        rate_ratio = self.times.best("copy") / self.times.best("in-place add") * (
            self.passes("in-place add") / self.passes("copy"))
        faults = self.times.faults["unfused"]
        return [
            write_allocate_verdict(rate_ratio),
            fusion_verdict(self.times.ratio("in-place unfused", "fused"),
                           self.passes("in-place unfused") / self.passes("fused")),
            allocation_verdict(self.times.ratio("unfused", "in-place unfused"),
                               None if faults is None else faults / self.steps),
        ]


FUSION_STUDY_HEADERS = ("variant", "tensor-sizes per step (counted)", "new tensors per step",
                        "ms per step", "GB/s (counted)", "of peak", "page faults per step")


def fusion_study_traffic(numel: int, *, device: DeviceLike = "cpu") -> dict[str, Traffic]:
    """Counted traffic of one step of each :func:`fusion_study_loops` loop on ``numel`` floats.

    Counted on 1,024-element tensors and scaled (the count per element does not
    depend on the size): two steps minus one step, so that what a loop does once
    (``unfused`` starts from ``zeros_like``) stays out of the per-step count.
    """
    check_positive_int("numel", numel)
    dev = timing_device(device) or torch.device("cpu")
    ones = torch.ones(1024, device=dev)
    traffic = {}
    for name in fusion_study_loops(ones, ones, 1):
        one, two = (count_traffic(fusion_study_loops(ones, ones, steps)[name])
                    for steps in (1, 2))
        traffic[name] = Traffic(
            (two.read - one.read) * numel // 1024, (two.written - one.written) * numel // 1024,
            two.fresh - one.fresh, two.ops - one.ops)
    return traffic


def fusion_study(
    device: DeviceLike, numel: int, *, steps: int, rounds: int, threads: int | None = None,
    progress: bool = False,
) -> FusionStudy:
    """Count and time :func:`fusion_study_loops` on ``device``, interleaved over ``rounds``.

    The traffic is counted on small tensors (the count per element does not depend
    on the size) and the loops are timed on float32 tensors of ``numel`` elements.
    ``threads`` sets ``torch.set_num_threads`` while timing a CPU (restored after).
    """
    dev = timing_device(device)
    if dev is None:
        raise ValueError("fusion_study needs a device, e.g. 'cpu' or 'cuda:0'")
    check_positive_int("numel", numel)
    check_positive_int("steps", steps)
    traffic = fusion_study_traffic(numel, device=dev)
    generator = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(numel, device=dev, generator=generator)
    b = torch.randn(numel, device=dev, generator=generator)
    before = torch.get_num_threads()
    if threads is not None and dev.type == "cpu":
        torch.set_num_threads(check_positive_int("threads", threads))
    try:
        times = interleaved_times(fusion_study_loops(a, b, steps), dev, rounds=rounds,
                                  progress=progress)
    finally:
        torch.set_num_threads(before)
    return FusionStudy(str(dev), numel, steps, traffic, times)


# --------------------------------------------------------------------------- #
# torch.utils.benchmark.Timer next to time_fn, and what a profiler trace shows
# --------------------------------------------------------------------------- #

#: time_fn and torch.utils.benchmark.Timer agree when their medians differ by at most this.
TIMER_TOLERANCE = 0.2


def timer_agreement_verdict(ratio: float, tolerance: float = TIMER_TOLERANCE,
                            calls_per_block: int = 1) -> str:
    """Whether Timer's median over time_fn's median (``ratio``) is within ``tolerance`` of 1."""
    check_positive_float("ratio", ratio)
    check_positive_float("tolerance", tolerance)
    check_positive_int("calls_per_block", calls_per_block)
    if abs(ratio - 1) <= tolerance:
        return (
            f"torch.utils.benchmark.Timer and time_fn agree: their medians differ by "
            f"{abs(ratio - 1):.0%}, within the {tolerance:.0%} tolerance."
        )
    return (
        f"torch.utils.benchmark.Timer's median is {ratio:.2f}x time_fn's, outside the "
        f"{tolerance:.0%} tolerance: Timer averaged blocks of {calls_per_block} calls, so each "
        "of its times holds every pause another program caused, where time_fn's median of "
        "single calls leaves the slow calls out. Give each call more work (a block of one call) "
        "to compare the same statistic."
    )


@dataclass(frozen=True)
class TimerAgreement:
    """``torch.utils.benchmark.Timer`` and :func:`~d2lgpu.timing.time_fn` on the same work."""

    benchmark_timer: Timing  # per-call time of each of Timer's blocks
    time_fn: Timing  # single calls
    calls_per_block: int

    @property
    def ratio(self) -> float:
        return self.benchmark_timer.median / self.time_fn.median

    def verdict(self, tolerance: float = TIMER_TOLERANCE) -> str:
        return timer_agreement_verdict(self.ratio, tolerance, self.calls_per_block)


def compare_with_benchmark_timer(
    fn: Callable[[], object], device: DeviceLike, *, rounds: int = 3, min_run_time: float = 0.2,
    repeats: int = 5, threads: int = 1,
) -> TimerAgreement:
    """Time ``fn()`` with ``Timer.blocked_autorange`` and with :func:`time_fn`, in rounds.

    Each round runs Timer for ``min_run_time`` seconds and then ``time_fn`` for
    ``repeats`` calls, so a burst of load lands on both. Both run with ``threads``
    CPU threads: ``Timer`` sets ``torch.set_num_threads(num_threads)``, 1 by default,
    while timing, so ``time_fn`` must do the same to time the same work.
    """
    check_callable("fn", fn, example="lambda: a * b")
    check_warmup_repeats(0, rounds)
    check_positive_int("threads", threads)
    dev = timing_device(device)
    from torch.utils import benchmark

    on_gpu = dev is not None and dev.type == "cuda"

    def clock() -> float:
        if on_gpu:
            torch.cuda.synchronize(dev)
        return timeit.default_timer()

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, timer=clock, num_threads=threads)
    blocks: list[float] = []
    singles: list[float] = []
    calls_per_block = 1
    before = torch.get_num_threads()
    try:
        for _ in range(rounds):
            measurement = timer.blocked_autorange(min_run_time=min_run_time)
            blocks += measurement.times
            calls_per_block = measurement.number_per_run
            torch.set_num_threads(threads)
            singles += time_fn(fn, dev, warmup=1, repeats=repeats).times
            torch.set_num_threads(before)
    finally:
        torch.set_num_threads(before)
    return TimerAgreement(Timing(tuple(blocks)), Timing(tuple(singles)), calls_per_block)


@dataclass(frozen=True)
class TraceSpans:
    """When, in a profiler trace, the host finished its calls and the device its kernels.

    Microseconds from the first host event. ``device_end`` is None when the trace
    holds no device events (a CPU-only run).
    """

    host_ops: int
    host_end: float
    kernels: int
    device_end: float | None


def trace_spans(events: Sequence[Any], host_names: Sequence[str] = ("aten::mul", "aten::add",
                                                                     "aten::addcmul_",
                                                                     "cudaLaunchKernel")
                ) -> TraceSpans:
    """Read :class:`TraceSpans` from ``prof.events()`` of a ``torch.profiler`` run.

    Host events are those named in ``host_names`` (the loop's operators and, on a
    GPU, its kernel launches); device events are those whose ``device_type`` is
    not the CPU (the kernels as the GPU ran them).
    """
    check_sequence("events", events, of="profiler events (prof.events())", allow_empty=True)
    host = [e for e in events if _is_host(e) and e.name in host_names]
    device = [e for e in events if not _is_host(e)]
    if not host:
        raise ValueError(f"no host event named one of {list(host_names)} in the trace")
    origin = min(e.time_range.start for e in host)
    return TraceSpans(
        host_ops=len(host),
        host_end=max(e.time_range.end for e in host) - origin,
        kernels=len(device),
        device_end=(max(e.time_range.end for e in device) - origin) if device else None,
    )


def _is_host(event: Any) -> bool:
    return str(getattr(event, "device_type", "CPU")).rsplit(".", 1)[-1] == "CPU"


#: The device still works after the host's last launch for at least this share of the
#: whole trace: the host ran ahead.
AHEAD_THRESHOLD = 0.2


def asynchrony_verdict(spans: TraceSpans) -> str:
    """What a trace's host and device spans say about who waited for whom."""
    if not isinstance(spans, TraceSpans):
        raise TypeError(f"spans must be the TraceSpans of trace_spans(prof.events()), got "
                        f"{type(spans).__name__}")
    if spans.device_end is None:
        return (
            f"The trace holds only host events: {spans.host_ops} operators ran on the calling "
            f"thread, one after another, and the last ended {spans.host_end / 1e3:.2f} ms after "
            "the first began. Each did its work before returning, so the host's clock is the "
            "work's clock."
        )
    behind = spans.device_end - spans.host_end
    if behind >= AHEAD_THRESHOLD * spans.device_end:
        return (
            f"The host issued its last call {spans.host_end / 1e3:.2f} ms into the trace; the "
            f"device finished its {spans.kernels} kernels at {spans.device_end / 1e3:.2f} ms, "
            f"{behind / 1e3:.2f} ms later: the CPU ran ahead and the GPU worked through the queue."
        )
    return (
        f"The device finished its {spans.kernels} kernels at {spans.device_end / 1e3:.2f} ms, "
        f"close behind the host's last call at {spans.host_end / 1e3:.2f} ms: the kernels are "
        "so short that launching them sets the pace (launch-bound)."
    )
