"""Chapter 2's measurements: the wrong timer, bandwidths, the multiply-add benchmark and the
fusion study (bytes counted per operator, loops timed in interleaved rounds)."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from d2lgpu.runtime.checks import check_positive_int, check_warmup_repeats, error_line
from d2lgpu.timing import (
    DeviceLike,
    Timing,
    gbps,
    synchronize,
    time_fn,
    timed_calls,
    timing_device,
)

__all__ = [
    "ElementwiseRow", "TransferRow", "FUSED_TENSOR_PASSES", "MULTIPLY_ADD_HEADERS",
    "MULTIPLY_ADD_VARIANTS", "UNFUSED_TENSOR_PASSES", "compile_on_devices", "compile_or_reason",
    "copy_buffer_bytes", "device_cache_bytes", "is_compiled", "last_level_cache_bytes",
    "measure_copy_bandwidth", "measure_host_to_device", "multiply_add_benchmark",
    "multiply_add_bytes", "multiply_add_fused", "multiply_add_sweep", "multiply_add_table",
    "multiply_add_unfused", "run_multiply_add", "time_naive",
]


def _needs_device(device: DeviceLike, what: str) -> torch.device:
    dev = timing_device(device)
    if dev is None:
        raise ValueError(f"{what} needs a device, e.g. 'cpu' or 'cuda:0'")
    return dev


def time_naive(fn: Callable[[], object], device: DeviceLike = None, *, warmup: int = 2,
               repeats: int = 10) -> Timing:
    """The WRONG way to time GPU work (chapter 2): like :func:`time_fn`, but the clock stops
    when ``fn()`` returns, which for GPU work is when its kernels are queued."""
    check_warmup_repeats(warmup, repeats)
    dev = timing_device(device)
    for _ in range(warmup):
        fn()
    return _naive_calls(fn, dev, repeats)


def _naive_calls(fn: Callable[[], object], device: torch.device | None, repeats: int) -> Timing:
    times = []
    for _ in range(repeats):
        synchronize(device)  # start from an idle device so earlier work does not leak in
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)  # no synchronisation: the mistake
    synchronize(device)
    return Timing(tuple(times))


_MIB = 2**20
_CPU0_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")  # one index* folder per cache
#: The copy buffer when the cache size is unknown: beyond common caches, yet small enough
#: for a laptop (two are allocated).
_DEFAULT_COPY_BYTES = 256 * _MIB


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0))  # Linux's, as is the sysfs that calls for it


def _parse_cache_size(text: str) -> int:
    """sysfs spells sizes "32K", "1024K", "32M" (binary units) or plain bytes."""
    text = text.strip().upper()
    return int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)


def _count_cpus(cpu_list: str) -> int:
    """How many CPUs a list such as "0-7,64-71" names."""
    count = 0
    for part in cpu_list.strip().split(","):
        first, _, last = part.partition("-")
        count += int(last) - int(first) + 1 if last else 1
    return count


def last_level_cache_bytes() -> tuple[int, str] | None:
    """The last-level CPU cache this process's threads can fill, and where it was read: CPU 0's
    in Linux's sysfs, times the caches the usable CPUs spread over (one L3 per core complex);
    None where sysfs does not say."""
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
    if best is None:
        return None
    level, size, sharing = best
    instances = math.ceil(_usable_cpus() / sharing)
    return size * instances, (
        f"level-{level} cache ({instances} x {size / _MIB:g} MiB, from {_CPU0_CACHE_DIR})")


def copy_buffer_bytes(device: DeviceLike) -> tuple[int, str]:
    """The buffer size :func:`measure_copy_bandwidth` uses on ``device``, and why (chapter 2):
    at least twice the last-level cache, so that the copy streams from memory."""
    dev = _needs_device(device, "copy_buffer_bytes")
    if dev.type == "cpu":
        cache = last_level_cache_bytes()
        if cache is None:
            return _DEFAULT_COPY_BYTES, (f"{_DEFAULT_COPY_BYTES // _MIB} MiB: this CPU's cache "
                                         "size is unknown, so one beyond common CPUs' caches")
        size, where = cache
        nbytes = max(64 * _MIB, math.ceil(2 * size / _MIB) * _MIB)
        return nbytes, f"{nbytes // _MIB} MiB: at least twice the {size / _MIB:g} MiB {where}"
    l2 = device_cache_bytes(dev) or 0
    nbytes = max(_DEFAULT_COPY_BYTES, math.ceil(2 * l2 / _MIB) * _MIB)
    return nbytes, f"{nbytes // _MIB} MiB: at least twice the {l2 / _MIB:g} MiB L2 cache"


def _copies_per_timing(seconds_per_copy: float) -> int:
    """Copies in one timing so that it holds 50 ms of work: a timing pays a fixed 10-20 us,
    one 256 MiB copy on an H100 lasts about 150 us."""
    if not (math.isfinite(seconds_per_copy) and seconds_per_copy > 0):
        return 10_000
    return max(1, min(10_000, math.ceil(0.05 / seconds_per_copy)))


def _cuda_seconds_per_copy(dst: torch.Tensor, src: torch.Tensor, device: torch.device, warmup: int,
                           repeats: int) -> float:
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


def measure_copy_bandwidth(device: DeviceLike, nbytes: int | None = None, *, warmup: int = 2,
                           repeats: int = 10) -> float:
    """Measured peak copy bandwidth of ``device``'s memory in GB/s, the best of ``repeats``
    timings of ``dst.copy_(src)``, counting the bytes read plus written (chapter 2)."""
    dev = _needs_device(device, "measure_copy_bandwidth")
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


# Tensor-sized memory passes per step of `result = result + a * b`:
# a * b reads 2 and writes 1 temporary, then + reads 2 and writes 1.
UNFUSED_TENSOR_PASSES = 6
# A fused kernel (result.addcmul_(a, b), or torch.compile) reads 3 and writes 1.
FUSED_TENSOR_PASSES = 4

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def multiply_add_unfused(result: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One step ``result + a * b`` as written: two kernels and a temporary (chapter 2)."""
    return result + a * b


def multiply_add_fused(result: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same step as one in-place kernel, ``result += a * b`` (``addcmul_``) (chapter 2)."""
    return result.addcmul_(a, b)


def run_multiply_add(step: StepFn, a: torch.Tensor, b: torch.Tensor, steps: int) -> torch.Tensor:
    """Start from zeros and apply ``result = step(result, a, b)`` ``steps`` times (chapter 2)."""
    result = torch.zeros_like(a)
    for _ in range(steps):
        result = step(result, a, b)
    return result


def multiply_add_bytes(numel: int, element_size: int, steps: int, tensor_passes: int) -> int:
    """Bytes moved by ``steps`` multiply-add steps on ``numel`` elements (chapter 2)."""
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


def multiply_add_benchmark(device: DeviceLike, numel: int, *, steps: int, step: StepFn,
                           tensor_passes: int, copy_gbps: float, variant: str, warmup: int = 1,
                           repeats: int = 5) -> ElementwiseRow:
    """Time ``steps`` multiply-add steps on float32 tensors of ``numel`` elements, and the
    bandwidth they reach as a share of ``copy_gbps``."""
    dev = timing_device(device)
    generator = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(numel, device=dev, generator=generator)
    b = torch.randn(numel, device=dev, generator=generator)
    try:
        timing = time_fn(
            lambda: run_multiply_add(step, a, b, steps), dev, warmup=warmup, repeats=repeats
        )
    except Exception as err:
        if not is_compiled(step):
            raise
        # compiled with fullgraph=True, dynamo raises where it would fall back to eager mode
        raise RuntimeError(
            f"the compiled {variant!r} step did not run compiled on {dev} at {numel:,} floats "
            f"({error_line(err)}). Call torch._dynamo.reset() before timing each device "
            "(multiply_add_sweep does), or drop the compiled variant."
        ) from err
    achieved = gbps(multiply_add_bytes(numel, a.element_size(), steps, tensor_passes),
                    timing.median)
    return ElementwiseRow(str(dev), variant, numel, steps, timing.median, achieved,
                          achieved / copy_gbps)


# name -> (step function, tensor-sized memory passes per step)
MULTIPLY_ADD_VARIANTS: dict[str, tuple[StepFn, int]] = {
    "unfused": (multiply_add_unfused, UNFUSED_TENSOR_PASSES),
    "fused": (multiply_add_fused, FUSED_TENSOR_PASSES),
}


def multiply_add_sweep(devices: Sequence[DeviceLike], sizes: Sequence[int], *, steps: int,
                       copy_gbps: Mapping[str, float],
                       variants: Mapping[str, tuple[StepFn, int]] = MULTIPLY_ADD_VARIANTS,
                       warmup: int = 1, repeats: int = 5) -> list[ElementwiseRow]:
    """:func:`multiply_add_benchmark` for every device, size and variant; ``copy_gbps`` maps
    ``str(device)`` to its copy bandwidth. Dynamo is reset before each device: it guards a
    compiled step on the device and would pass its recompile limit with several GPUs."""
    compiled = any(is_compiled(step) for step, _ in variants.values())
    rows = []
    for device in devices:
        dev = timing_device(device)
        if compiled:
            _reset_dynamo()  # a fresh cache, and a fresh recompile budget, per device
        for numel in sizes:
            for name, (step, passes) in variants.items():
                rows.append(multiply_add_benchmark(
                    dev, numel, steps=steps, step=step, tensor_passes=passes,
                    copy_gbps=copy_gbps[str(dev)], variant=name, warmup=warmup, repeats=repeats))
    return rows


MULTIPLY_ADD_HEADERS = ("floats", "variant", "device", "ms", "speed-up vs cpu", "GB/s",
                        "% of copy peak")


def multiply_add_table(rows: Sequence[ElementwiseRow]) -> list[list[Any]]:
    """Table rows for :data:`MULTIPLY_ADD_HEADERS`, sorted by size, variant and device; the
    speed-up is over the CPU row of the same size and variant ("-" without one)."""
    cpu_seconds = {(r.numel, r.variant): r.seconds for r in rows if r.device == "cpu"}
    table = []
    for r in sorted(rows, key=lambda r: (r.numel, r.variant, r.device)):
        base = cpu_seconds.get((r.numel, r.variant))
        table.append([r.numel, r.variant, r.device, r.seconds * 1e3,
                      base / r.seconds if base is not None else "-", r.gbps,
                      100 * r.share_of_copy_peak])
    return table


def _reset_dynamo() -> None:
    import torch._dynamo  # loaded already wherever torch.compile made a step

    torch._dynamo.reset()


def is_compiled(step: object) -> bool:
    """Whether ``step`` is a function returned by ``torch.compile``."""
    return getattr(step, "_torchdynamo_orig_callable", None) is not None


def compile_or_reason(step: StepFn, device: DeviceLike, *,
                      backend: str = "inductor") -> tuple[StepFn | None, str]:
    """``torch.compile(step, fullgraph=True)`` if it works on ``device`` here, else why not
    (chapter 2): run once and checked against eager mode, as compilation is lazy."""
    dev = timing_device(device)
    try:
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        a = torch.randn(1024, device=dev)
        b = torch.randn(1024, device=dev)
        got = compiled(torch.zeros_like(a), a, b)
        if not torch.allclose(got, step(torch.zeros_like(a), a, b)):
            return None, "torch.compile ran but its result differs from eager mode"
    except Exception as err:  # any failure means "not usable here"; the reason is shown
        return None, f"torch.compile is not usable here: {error_line(err)}"
    return compiled, f"torch.compile (backend={backend!r}) works here"


def compile_on_devices(step: StepFn, devices: Sequence[DeviceLike], *,
                       backend: str = "inductor") -> tuple[StepFn | None, list[str]]:
    """:func:`compile_or_reason` on each device in turn, with dynamo reset before each (its
    recompile limit, 8, would fail the ninth device); stops at the first failure."""
    compiled: StepFn | None = None
    reasons = []
    for device in devices:
        _reset_dynamo()
        compiled, reason = compile_or_reason(step, device, backend=backend)
        reasons.append(f"{timing_device(device)}: {reason}")
        if compiled is None:
            break
    return compiled, reasons


@dataclass(frozen=True)
class TransferRow:
    """Host-to-device copy of ``nbytes`` bytes from pageable and from pinned memory."""

    nbytes: int
    pageable_gbps: float
    pinned_gbps: float
    pinned_seconds: float  # median time until a pinned copy has finished
    non_blocking_call_seconds: float  # median time until .to(non_blocking=True) returned


def measure_host_to_device(device: DeviceLike, sizes: Sequence[int], *, warmup: int = 2,
                           repeats: int = 10) -> list[TransferRow]:
    """Host-to-device bandwidth for each byte count in ``sizes``, from pageable and from pinned
    memory (only from pinned memory does ``non_blocking=True`` return at once) (chapter 2)."""
    dev = timing_device(device)
    if dev is None or dev.type != "cuda":
        raise RuntimeError(f"host-to-device transfers are measured on a CUDA GPU, got {dev}; "
                           "there is no host-to-device link to measure on the CPU")
    rows = []
    for nbytes in sizes:
        check_positive_int("each size (bytes)", nbytes)
        pageable = torch.ones(nbytes, dtype=torch.uint8)
        pinned = pageable.pin_memory()
        pageable_t = time_fn(partial(pageable.to, dev), dev, warmup=warmup, repeats=repeats)
        pinned_t = time_fn(partial(pinned.to, dev), dev, warmup=warmup, repeats=repeats)
        call = partial(pinned.to, dev, non_blocking=True)
        call_t = time_naive(call, dev, warmup=warmup, repeats=repeats)
        rows.append(TransferRow(nbytes, gbps(nbytes, pageable_t.median),
                                gbps(nbytes, pinned_t.median), pinned_t.median, call_t.median))
    return rows


@dataclass(frozen=True)
class TimerComparison:
    """The naive and the synchronised timer on the same work, measured side by side."""

    device: str
    naive: Timing
    synchronised: Timing

    @property
    def ratio(self) -> float:  # 1 when the two agree
        return self.naive.median / self.synchronised.median


def compare_timers(fn: Callable[[], object], device: DeviceLike, *, warmup: int = 1,
                   repeats: int = 5) -> TimerComparison:
    """Time ``fn()`` with :func:`time_naive` and :func:`time_fn`, alternating run by run, so
    that a burst of load from another program lands on both (chapter 2)."""
    check_warmup_repeats(warmup, repeats)
    dev = _needs_device(device, "compare_timers")
    for _ in range(warmup):
        fn()
    naive, synced = [], []
    for _ in range(repeats):  # the device was checked once, above
        naive += _naive_calls(fn, dev, 1).times
        synced += timed_calls(fn, dev, 1).times
    return TimerComparison(str(dev), Timing(tuple(naive)), Timing(tuple(synced)))


def device_cache_bytes(device: DeviceLike) -> int | None:
    """The last-level cache in front of ``device``'s memory, in bytes; None if unknown
    (chapter 2)."""
    dev = timing_device(device)
    if dev is not None and dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).L2_cache_size) or None
    if dev is None or dev.type != "cpu":
        return None
    found = last_level_cache_bytes()
    return None if found is None else found[0]


#: Operators that write their first argument without reading it first.
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_"}


@dataclass(frozen=True)
class Traffic:
    """Bytes read and written, counted from the operators' arguments; ``fresh``: new result
    tensors; ``ops``: aten operators run."""

    read: int
    written: int
    fresh: int
    ops: int

    @property
    def moved(self) -> int:
        return self.read + self.written


def count_traffic(fn: Callable[[], object]) -> Traffic:
    """Run ``fn()`` once and count the bytes its aten operators read and write (chapter 2): an
    argument written in place is read and written, an ``out=`` or ``copy_`` destination only
    written; views cost nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

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
            totals["read"] += sum(t.nbytes for t in inputs)
            totals["written"] += sum(t.nbytes for t in written)
            return out

    with Counter():
        fn()
    return Traffic(**totals)


def fusion_study_loops(a: torch.Tensor, b: torch.Tensor,
                       steps: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The fusion study's loops of ``steps`` steps: two yardsticks and three ways to write
    ``result += a * b``; the buffers are allocated here, once (chapter 2)."""
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
    """Timings of several loops taken in rounds: ``seconds[name][i]`` is round ``i`` of loop
    ``name``; ``faults[name]`` the median minor page faults per run (None: not counted)."""

    seconds: dict[str, tuple[float, ...]]
    faults: dict[str, float | None]


def interleaved_times(loops: Mapping[str, Callable[[], object]], device: DeviceLike, *,
                      rounds: int, warmup: int = 1, progress: bool = False) -> InterleavedTimes:
    """Time every loop once per round, the order rotating each round, so that a burst of
    load from other programs spreads over all loops and none always runs first."""
    import warnings

    with warnings.catch_warnings():  # without ipywidgets tqdm.auto warns, then draws text
        warnings.simplefilter("ignore")
        from tqdm.auto import tqdm

    dev = timing_device(device)
    names = list(loops)
    for _ in range(warmup):
        for name in names:
            loops[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[int]] = {name: [] for name in names}
    for r in tqdm(range(rounds), desc="rounds", unit="round", disable=not progress):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            before = _minor_page_faults()
            seconds[name] += timed_calls(loops[name], dev, 1).times  # dev checked above
            after = _minor_page_faults()
            if before is not None and after is not None:
                faults[name].append(after - before)
    return InterleavedTimes(
        {name: tuple(times) for name, times in seconds.items()},
        {name: (float(statistics.median(f)) if f else None) for name, f in faults.items()},
    )


@dataclass(frozen=True)
class FusionStudy:
    """The fusion study on one device: traffic counted per step, times per loop."""

    device: str
    numel: int
    steps: int
    traffic: dict[str, Traffic]
    times: InterleavedTimes

    def passes(self, name: str) -> float:  # counted tensor-sizes moved per step
        return self.traffic[name].moved / (self.numel * 4)

    def seconds_per_step(self, name: str) -> float:
        """The fastest round's time of loop ``name``, per step: other programs can only add
        time, so that round is the least disturbed."""
        return min(self.times.seconds[name]) / self.steps

    def gbps(self, name: str) -> float:
        return gbps(self.traffic[name].moved, self.seconds_per_step(name))

    @property
    def peak_gbps(self) -> float:
        return max(self.gbps(name) for name in self.times.seconds)

    def table(self) -> list[list[Any]]:
        rows = []
        for name in self.times.seconds:
            faults = self.times.faults[name]
            rows.append([
                name, f"{self.passes(name):g}", self.traffic[name].fresh,
                f"{self.seconds_per_step(name) * 1e3:.2f}", f"{self.gbps(name):.1f}",
                f"{100 * self.gbps(name) / self.peak_gbps:.0f} %",
                "-" if faults is None else f"{faults / self.steps:,.0f}",
            ])
        return rows


FUSION_STUDY_HEADERS = ("variant", "tensor-sizes per step (counted)", "new tensors per step",
                        "best ms per step", "GB/s (counted)", "of peak", "page faults per step")


def fusion_study_traffic(numel: int, *, device: DeviceLike = "cpu") -> dict[str, Traffic]:
    """Counted traffic of one step of each :func:`fusion_study_loops` loop on ``numel`` floats
    (chapter 2): two steps minus one on 1,024 floats, scaled, so set-up stays out."""
    check_positive_int("numel", numel)
    dev = timing_device(device) or torch.device("cpu")
    ones = torch.ones(1024, device=dev)
    traffic = {}
    for name in fusion_study_loops(ones, ones, 1):
        one, two = (count_traffic(fusion_study_loops(ones, ones, n)[name]) for n in (1, 2))
        traffic[name] = Traffic(
            (two.read - one.read) * numel // 1024, (two.written - one.written) * numel // 1024,
            two.fresh - one.fresh, two.ops - one.ops)
    return traffic


def fusion_study(device: DeviceLike, numel: int, *, steps: int, rounds: int,
                 progress: bool = False) -> FusionStudy:
    """Count and time :func:`fusion_study_loops` on float32 tensors of ``numel`` elements,
    in ``rounds`` interleaved rounds (chapter 2)."""
    dev = _needs_device(device, "fusion_study")
    check_positive_int("numel", numel)
    check_positive_int("steps", steps)
    check_warmup_repeats(1, rounds)
    traffic = fusion_study_traffic(numel, device=dev)
    generator = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(numel, device=dev, generator=generator)
    b = torch.randn(numel, device=dev, generator=generator)
    times = interleaved_times(fusion_study_loops(a, b, steps), dev, rounds=rounds,
                              progress=progress)
    return FusionStudy(str(dev), numel, steps, traffic, times)


@dataclass(frozen=True)
class TraceSpans:
    """When, in microseconds from the first host event of a profiler trace, the host finished
    its calls and the device its kernels (None: no device events, a CPU-only run)."""

    host_ops: int
    host_end: float
    kernels: int
    device_end: float | None


_HOST_NAMES = ("aten::mul", "aten::add", "aten::addcmul_", "cudaLaunchKernel")


def trace_spans(events: Sequence[Any]) -> TraceSpans:
    """Read :class:`TraceSpans` from ``prof.events()`` of a ``torch.profiler`` run (chapter 2):
    host events are those named in ``_HOST_NAMES``, device events the non-CPU ones."""
    def on_host(event: Any) -> bool:
        return str(getattr(event, "device_type", "CPU")).rsplit(".", 1)[-1] == "CPU"

    host = [e for e in events if on_host(e) and e.name in _HOST_NAMES]
    device = [e for e in events if not on_host(e)]
    if not host:
        raise ValueError(f"no host event named one of {list(_HOST_NAMES)} in the trace")
    origin = min(e.time_range.start for e in host)
    device_end = max(e.time_range.end for e in device) - origin if device else None
    return TraceSpans(len(host), max(e.time_range.end for e in host) - origin, len(device),
                      device_end)
