"""Chapter 7's exercise checks fail on plausible wrong answers, not only on the stubs.

Each wrong answer below is a slip a learner makes: counting the rows of the profiler's table
instead of an operator's calls, a lookup that fails for an operator that never ran, a roofline
that takes the faster of the two roofs or calls the ridge compute-bound from the wrong side, a
rewrite that still reads a Python number, a copy that replaces the recorded tensors or
converts a dtype without a word. Every check must reject it with ``ExerciseWrong`` and pass the
right answer (the solutions notebook runs the same answers).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from d2lgpu.exercises import ExerciseWrong
from d2lgpu.exercises import ch07 as check

# ---------------------------------------------------------------------------
# 7.1 count_calls
# ---------------------------------------------------------------------------


def _profiled(work):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    return prof


def _count_calls(work, op):
    return next((e.count for e in _profiled(work).key_averages() if e.key == op), 0)


def _count_rows(work, op):
    # Counts the table's rows for op (one), not how often it ran.
    return sum(1 for e in _profiled(work).key_averages() if e.key == op)


def _count_without_default(work, op):
    # An op that never ran has no row: next() without a default raises StopIteration.
    return next(e.count for e in _profiled(work).key_averages() if e.key == op)


def test_count_calls_passes_the_right_answer():
    check.count_calls(_count_calls)


@pytest.mark.parametrize("wrong", [_count_rows, _count_without_default])
def test_count_calls_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.count_calls(wrong)


# ---------------------------------------------------------------------------
# 7.2 roofline_time
# ---------------------------------------------------------------------------


def _refuse(flops, nbytes):
    if flops < 0 or nbytes <= 0:
        raise ValueError(f"{flops} FLOPs over {nbytes} bytes is not an operation")


def _roofline_time(flops, nbytes, roofline):
    _refuse(flops, nbytes)
    compute = flops / (roofline.peak_tflops * 1e12)
    memory = nbytes / (roofline.bandwidth_gbps * 1e9)
    return max(compute, memory), ("compute-bound" if flops / nbytes >= roofline.ridge
                                  else "memory-bound")


def _faster_roof(flops, nbytes, roofline):
    # The faster of the two roofs: a bound the operation can never reach.
    _refuse(flops, nbytes)
    compute = flops / (roofline.peak_tflops * 1e12)
    memory = nbytes / (roofline.bandwidth_gbps * 1e9)
    return min(compute, memory), ("compute-bound" if compute <= memory else "memory-bound")


def _ridge_reversed(flops, nbytes, roofline):
    # The right time, the regimes swapped: compute-bound below the ridge.
    seconds, _ = _roofline_time(flops, nbytes, roofline)
    return seconds, ("memory-bound" if flops / nbytes >= roofline.ridge else "compute-bound")


def _no_checks(flops, nbytes, roofline):
    # Accepts negative FLOPs and divides by zero bytes.
    compute = flops / (roofline.peak_tflops * 1e12)
    memory = nbytes / (roofline.bandwidth_gbps * 1e9) if nbytes else 0.0
    return max(compute, memory), "compute-bound" if compute >= memory else "memory-bound"


def _tera_giga_mixed(flops, nbytes, roofline):
    # TFLOP/s and GB/s taken as the same unit.
    _refuse(flops, nbytes)
    compute = flops / (roofline.peak_tflops * 1e12)
    memory = nbytes / (roofline.bandwidth_gbps * 1e12)
    return max(compute, memory), ("compute-bound" if flops / nbytes >= roofline.ridge
                                  else "memory-bound")


def test_roofline_time_passes_the_right_answer():
    check.roofline_time(_roofline_time)


@pytest.mark.parametrize("wrong", [_faster_roof, _ridge_reversed, _no_checks, _tera_giga_mixed])
def test_roofline_time_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.roofline_time(wrong)


# ---------------------------------------------------------------------------
# 7.4 no_graph_break
# ---------------------------------------------------------------------------


def _on_device(x):
    positives = (x > 0).sum()
    x = torch.where(positives > x.numel() // 2, x - x.mean(), x)
    limit = x.abs().max()
    return x.clamp(-limit / 2, limit / 2)


def _still_reads_a_number(x):
    # The branch as a tensor, the limit still a Python float: one break left.
    positives = (x > 0).sum()
    x = torch.where(positives > x.numel() // 2, x - x.mean(), x)
    limit = x.abs().max().item()
    return x.clamp(-limit / 2, limit / 2)


def _branch_dropped(x):
    # No break, but the centring now happens for every input.
    x = x - x.mean()
    limit = x.abs().max()
    return x.clamp(-limit / 2, limit / 2)


def _strict_majority_lost(x):
    # >= where the original has >: exactly half positive is centred too.
    positives = (x > 0).sum()
    x = torch.where(positives >= x.numel() // 2, x - x.mean(), x)
    limit = x.abs().max()
    return x.clamp(-limit / 2, limit / 2)


def test_no_graph_break_passes_the_right_answer():
    check.no_graph_break(_on_device)


@pytest.mark.parametrize("wrong", [_still_reads_a_number, _branch_dropped,
                                   _strict_majority_lost])
def test_no_graph_break_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.no_graph_break(wrong)


# ---------------------------------------------------------------------------
# 7.6 copy_into_static
# ---------------------------------------------------------------------------


def _copy_into_static(static, batch):
    if len(batch) != len(static):
        raise ValueError(f"recorded with {len(static)} tensors, got {len(batch)}")
    for s, b in zip(static, batch, strict=True):
        if s.shape != b.shape or s.dtype != b.dtype:
            raise ValueError(f"recorded {tuple(s.shape)} {s.dtype}, got {tuple(b.shape)} {b.dtype}")
    for s, b in zip(static, batch, strict=True):
        s.copy_(b)
    return static


def _replaces(static, batch):
    # New tensors: the recording still reads the old ones.
    return tuple(b.clone() for b in batch)


def _converts_dtypes(static, batch):
    # Checks shapes only: copy_ turns int32 labels into int64 without a word.
    if len(batch) != len(static) or any(s.shape != b.shape
                                        for s, b in zip(static, batch, strict=True)):
        raise ValueError("shapes differ")
    for s, b in zip(static, batch, strict=True):
        s.copy_(b)
    return static


def _copies_before_checking(static, batch):
    # Refuses, but only after the first tensors were overwritten.
    for s, b in zip(static, batch, strict=False):
        if s.shape != b.shape or s.dtype != b.dtype:
            raise ValueError("mismatch")
        s.copy_(b)
    if len(batch) != len(static):
        raise ValueError("count")
    return static


def test_copy_into_static_passes_the_right_answer():
    check.copy_into_static(_copy_into_static)


@pytest.mark.parametrize("wrong", [_replaces, _converts_dtypes, _copies_before_checking])
def test_copy_into_static_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.copy_into_static(wrong)
