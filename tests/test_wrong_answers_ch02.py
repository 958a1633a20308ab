"""Chapter 2's exercise checks fail on plausible wrong answers, not only on the stubs.

Each wrong answer below is a slip a learner makes: a timer that stops the clock before the
device has finished, a mean for a median, a reduction counted as a full tensor, a matrix
product whose output is never written, a device that starts a kernel before its launch has
returned. Every check must reject it with ``ExerciseWrong`` and pass the right answer (the
solutions notebook runs the same answers).
"""

from __future__ import annotations

import statistics
from time import perf_counter

import pytest

from d2lgpu.exercises import ExerciseWrong
from d2lgpu.exercises import ch02 as check

# ---------------------------------------------------------------------------
# 2.1 timed_median
# ---------------------------------------------------------------------------


def _check_counts(warmup: int, repeats: int) -> None:
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup}, {repeats}")


def _timed_median(work, synchronize, *, warmup=2, repeats=5, clock=perf_counter):
    _check_counts(warmup, repeats)
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        synchronize()
        start = clock()
        work()
        synchronize()
        times.append(clock() - start)
    return statistics.median(times)


def _naive(work, synchronize, *, warmup=2, repeats=5, clock=perf_counter):
    # The chapter's naive timer: stops the clock when the work is queued, not done.
    _check_counts(warmup, repeats)
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        synchronize()
        start = clock()
        work()
        times.append(clock() - start)
    return statistics.median(times)


def _no_wait_before_start(work, synchronize, *, warmup=2, repeats=5, clock=perf_counter):
    # Waits only at the end: the warm-up's queued work leaks into the first timing.
    _check_counts(warmup, repeats)
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        start = clock()
        work()
        synchronize()
        times.append(clock() - start)
    return statistics.median(times)


def _mean(work, synchronize, *, warmup=2, repeats=5, clock=perf_counter):
    # Right timings, wrong statistic: one slow call drags the mean.
    _check_counts(warmup, repeats)
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        synchronize()
        start = clock()
        work()
        synchronize()
        times.append(clock() - start)
    return statistics.mean(times)


def _no_value_error(work, synchronize, *, warmup=2, repeats=5, clock=perf_counter):
    # Right for sensible counts, but returns 0 for repeats=0 instead of refusing it.
    if repeats < 1 or warmup < 0:
        return 0.0
    return _timed_median(work, synchronize, warmup=warmup, repeats=repeats, clock=clock)


def test_timed_median_passes_the_right_answer():
    check.timed_median(_timed_median)


@pytest.mark.parametrize("wrong", [_naive, _no_wait_before_start, _mean, _no_value_error])
def test_timed_median_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.timed_median(wrong)


# ---------------------------------------------------------------------------
# 2.2 mse_bytes
# ---------------------------------------------------------------------------


def _mse_bytes(numel: int, element_size: int) -> tuple[int, int]:
    as_written = (3 * numel + 2 * numel + numel + 1) * element_size  # sub, pow, mean
    return as_written, (2 * numel + 1) * element_size


def _mean_writes_a_tensor(numel: int, element_size: int) -> tuple[int, int]:
    # Counts the mean's output as a whole tensor instead of one element.
    return (3 * numel + 2 * numel + 2 * numel) * element_size, (2 * numel + 1) * element_size


def _fused_writes_a_tensor(numel: int, element_size: int) -> tuple[int, int]:
    # The fused kernel written as if it stored the squared differences too.
    return _mse_bytes(numel, element_size)[0], 3 * numel * element_size


def _elements_not_bytes(numel: int, element_size: int) -> tuple[int, int]:
    # Counts elements and forgets the element size.
    return 6 * numel + 1, 2 * numel + 1


def test_mse_bytes_passes_the_right_answer():
    check.mse_bytes(_mse_bytes)


@pytest.mark.parametrize("wrong", [_mean_writes_a_tensor, _fused_writes_a_tensor,
                                   _elements_not_bytes])
def test_mse_bytes_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.mse_bytes(wrong)


# ---------------------------------------------------------------------------
# 2.4 matmul_intensity
# ---------------------------------------------------------------------------


def _check_sizes(*sizes: int) -> None:
    if min(sizes) < 1:
        raise ValueError(f"sizes must be positive, got {sizes}")


def _matmul_intensity(m: int, n: int, k: int, element_size: int) -> float:
    _check_sizes(m, n, k, element_size)
    return 2 * m * n * k / ((m * k + k * n + m * n) * element_size)


def _one_flop_per_multiply_add(m: int, n: int, k: int, element_size: int) -> float:
    # Counts a multiply-add as one FLOP; torch (and every datasheet) counts two.
    _check_sizes(m, n, k, element_size)
    return m * n * k / ((m * k + k * n + m * n) * element_size)


def _output_never_written(m: int, n: int, k: int, element_size: int) -> float:
    # Counts the inputs read but not the output written.
    _check_sizes(m, n, k, element_size)
    return 2 * m * n * k / ((m * k + k * n) * element_size)


def _accepts_zero(m: int, n: int, k: int, element_size: int) -> float:
    # Right for positive sizes, returns 0 for a zero instead of refusing it.
    if min(m, n, k, element_size) < 1:
        return 0.0
    return _matmul_intensity(m, n, k, element_size)


def test_matmul_intensity_passes_the_right_answer():
    check.matmul_intensity(_matmul_intensity)


@pytest.mark.parametrize("wrong", [_one_flop_per_multiply_add, _output_never_written,
                                   _accepts_zero])
def test_matmul_intensity_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.matmul_intensity(wrong)


# ---------------------------------------------------------------------------
# 2.5 timeline
# ---------------------------------------------------------------------------


def _check_times(launch: float, kernels: list[float]) -> None:
    if launch < 0 or any(k < 0 for k in kernels):
        raise ValueError("times cannot be negative")


def _timeline(launch: float, kernels: list[float]) -> tuple[float, float]:
    _check_times(launch, kernels)
    host = device = 0.0
    for seconds in kernels:
        host += launch
        device = max(device, host) + seconds
    return host, device


def _device_never_waits_for_launches(launch: float, kernels: list[float]) -> tuple[float, float]:
    # The device starts the next kernel as soon as the last one ends, launched or not.
    _check_times(launch, kernels)
    return launch * len(kernels), (launch + sum(kernels)) if kernels else 0.0


def _launch_and_kernel_in_series(launch: float, kernels: list[float]) -> tuple[float, float]:
    # The host waits for every kernel before launching the next: a synchronous device.
    _check_times(launch, kernels)
    return launch * len(kernels), sum(launch + k for k in kernels)


def test_timeline_passes_the_right_answer():
    check.timeline(_timeline)


@pytest.mark.parametrize("wrong", [_device_never_waits_for_launches,
                                   _launch_and_kernel_in_series])
def test_timeline_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.timeline(wrong)
