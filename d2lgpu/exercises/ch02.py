"""Checks for chapter 2's exercises (device placement, transfers and timing)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from d2lgpu.benchmarking import count_traffic
from d2lgpu.exercises import (
    ExerciseWrong,
    attempt,
    expect,
    expect_close,
    expect_value_error,
    passed,
)
from d2lgpu.timing import Timing


class _FakeDevice:
    """A device that runs behind the host's back: ``fn()`` costs the host ``LAUNCH`` seconds
    and queues the next of ``durations``; every ``clock()`` reading notes what was queued."""

    LAUNCH = 0.001

    def __init__(self, durations: list[float]) -> None:
        self.durations = list(durations)
        self.now = 0.0
        self.queued = 0.0
        self.calls = 0
        self.readings: list[tuple[float, float]] = []  # (time read, work still queued)

    def fn(self) -> None:
        if self.calls >= len(self.durations):
            raise ExerciseWrong(
                f"Exercise 2.1: fn was called more than the {len(self.durations)} times "
                "warmup + repeats asks for")
        self.now += self.LAUNCH
        self.queued += self.durations[self.calls]
        self.calls += 1

    def synchronize(self) -> None:
        self.now += self.queued
        self.queued = 0.0

    def clock(self) -> float:
        self.readings.append((self.now, self.queued))
        return self.now


def timed_median(fn: Callable[..., float]) -> None:
    """Exercise 2.1: ``fn(work, synchronize, *, warmup, repeats, clock)``, the median time of
    ``repeats`` calls of ``work`` after ``warmup`` untimed ones, each waited for."""
    ex = "2.1"
    cases = [
        (2, [5.0, 5.0], [0.010, 0.012, 0.011, 0.200, 0.013]),
        (1, [3.0], [0.020, 0.040, 0.030, 0.500]),
        (0, [], [0.25]),
    ]
    for warmup, slow, timed in cases:
        device = _FakeDevice(slow + timed)
        got = attempt(ex, fn, device.fn, device.synchronize, warmup=warmup,
                      repeats=len(timed), clock=device.clock)
        expect(ex, device.calls == warmup + len(timed),
               f"with warmup={warmup}, repeats={len(timed)} the work ran {device.calls} "
               f"times, expected {warmup + len(timed)}")
        late = [queued for _, queued in device.readings if queued > 0]
        expect(ex, not late,
               f"with warmup={warmup}, repeats={len(timed)}, the clock was read while "
               f"{late[0] if late else 0:g} s of work were still queued on the device: "
               "call synchronize() before every reading of the clock, the one that starts a "
               "timing (earlier work, warm-up included, must not leak in) and the one that "
               "stops it (the naive timer's mistake)")
        want = Timing(tuple(_FakeDevice.LAUNCH + t for t in timed)).median
        expect_close(ex, got, want,
                     f"with warmup={warmup}, repeats={len(timed)}, device times {timed} s "
                     f"(each call also costs the host {_FakeDevice.LAUNCH} s to launch), the "
                     "median (statistics.median of the timed calls only)", rel_tol=1e-9)
    noop = _FakeDevice([0.0] * 5)
    for warmup, repeats, why in [(1, 0, "repeats=0 leaves nothing to take the median of"),
                                 (-1, 3, "warmup=-1 is no number of calls")]:
        counts = functools.wraps(fn)(functools.partial(fn, warmup=warmup, repeats=repeats,
                                                       clock=noop.clock))
        expect_value_error(ex, counts, (noop.fn, noop.synchronize), why)
    passed(ex, "the clock is read only after the device has finished, and the warm-up calls' "
               "5 s stay out of a median of 13 ms")


def mse_bytes(fn: Callable[[int, int], tuple[int, int]]) -> None:
    """Exercise 2.2: ``fn(numel, element_size)``, bytes read plus written by
    ``((pred - target) ** 2).mean()`` as written (three kernels), and by one fused kernel."""
    ex = "2.2"
    for numel, dtype in ((1000, torch.float32), (4096, torch.bfloat16), (777, torch.float64),
                         (1, torch.float16)):
        element_size = torch.empty(0, dtype=dtype).element_size()
        got = attempt(ex, fn, numel, element_size)
        expect(ex, isinstance(got, (tuple, list)) and len(got) == 2,
               f"return a pair (bytes as written, bytes fused), got {got!r}")
        pred = torch.linspace(-1, 1, numel, dtype=dtype)
        target = torch.zeros(numel, dtype=dtype)
        unfused = count_traffic(lambda p=pred, t=target: ((p - t) ** 2).mean()).moved
        fused = (2 * numel + 1) * element_size
        expect(ex, got[0] == unfused,
               f"{numel:,} elements of {element_size} bytes, as written: got {got[0]:,} bytes, "
               f"the chapter's counter (bm.count_traffic) says {unfused:,}. Count every "
               "kernel: pred - target reads 2 tensors and writes 1, ** 2 reads 1 and writes 1, "
               ".mean() reads 1 and writes one element")
        expect(ex, got[1] == fused,
               f"{numel:,} elements of {element_size} bytes, fused: got {got[1]:,} bytes, "
               f"expected {fused:,}: one kernel reads pred and target once and writes one "
               "element, the mean")
    passed(ex, "the loss as written moves 6 tensor-sizes and one element, one fused kernel 2 "
               "and one element: 3x fewer bytes")


def matmul_intensity(fn: Callable[[int, int, int, int], float]) -> None:
    """Exercise 2.4: ``fn(m, n, k, element_size)``, FLOPs per byte of an (m x k) @ (k x n)
    product that reads both inputs once and writes its output once."""
    ex = "2.4"
    for m, n, k, dtype in ((64, 64, 64, torch.float32), (128, 32, 256, torch.float16),
                           (1, 1024, 1024, torch.bfloat16), (8, 8, 8, torch.float64)):
        element_size = torch.empty(0, dtype=dtype).element_size()
        got = attempt(ex, fn, m, n, k, element_size)
        from torch.utils.flop_counter import FlopCounterMode  # after the stub has had its say

        a, b = torch.ones(m, k, dtype=dtype), torch.ones(k, n, dtype=dtype)
        with FlopCounterMode(display=False) as flops:
            a @ b
        moved = count_traffic(lambda a=a, b=b: a @ b).moved
        want = flops.get_total_flops() / moved
        expect_close(ex, got, want,
                     f"matmul_intensity({m}, {n}, {k}, {element_size}) (torch's FlopCounterMode "
                     f"counts {flops.get_total_flops():,} FLOPs, the chapter's counter "
                     f"{moved:,} bytes)", rel_tol=1e-9)
    for args in ((0, 4, 4, 2), (4, 4, -1, 2), (4, 4, 4, 0)):
        expect_value_error(ex, fn, args, f"matmul_intensity{args} has a size that is not positive")
    passed(ex, "a 4096-cubed bf16 product does 1,365 FLOPs per byte, a matrix-vector product "
               "about 1, the fused multiply-add 1/8")


def _timeline(launch: float, kernels: list[float]) -> tuple[float, float]:
    host = gpu = 0.0
    for seconds in kernels:
        host += launch  # the launch returns: the kernel is queued
        gpu = max(gpu, host) + seconds  # it starts when queued and the one before is done
    return host, gpu


def timeline(fn: Callable[[float, list[float]], tuple[float, float]]) -> None:
    """Exercise 2.5: ``fn(launch_seconds, kernel_seconds)``, when the host has launched every
    kernel and when the device has finished them, from an idle start at time 0."""
    ex = "2.5"
    cases = [(0.1, [1.0]), (0.1, [1.0, 1.0, 1.0]), (5e-6, [2e-6] * 100),
             (5e-6, [1e-3] * 201), (1.0, [0.5, 3.0, 0.5, 0.5, 0.5]), (2.0, [])]
    for launch, kernels in cases:
        got = attempt(ex, fn, launch, list(kernels))
        expect(ex, isinstance(got, (tuple, list)) and len(got) == 2,
               f"return a pair (host done, device done), got {got!r}")
        host, device = _timeline(launch, kernels)
        shown = f"{len(kernels)} x {kernels[0]:g} s" if len(set(kernels)) == 1 else str(kernels)
        expect_close(ex, got[0], host,
                     f"launches of {launch:g} s, kernels {shown}: the host's time", rel_tol=1e-9)
        expect_close(ex, got[1], device,
                     f"launches of {launch:g} s, kernels {shown}: the device's time (a kernel "
                     "starts once its launch has returned and the kernel before it is done)",
                     rel_tol=1e-9)
    expect_value_error(ex, fn, (-1e-6, [1.0]), "a launch cannot take negative time")
    expect_value_error(ex, fn, (1e-6, [1.0, -1.0]), "a kernel cannot take negative time")
    passed(ex, "100 kernels of 2 us launched every 5 us keep the device idle 60% of the time, "
               "and the naive timer is right for once")
