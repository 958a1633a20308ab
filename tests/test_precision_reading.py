"""Tests of the helpers that read a precision sweep: the comparison and the time estimate."""

import pytest
import torch

import d2lgpu.precision as P
from d2lgpu.precision import (
    SweepRow,
    estimate_sweep_seconds,
)


def _row(mode, batch, seconds=0.01, peak=None, loss=2.3, status="ok"):
    ok = status == "ok"
    saved = (1000 if mode == "fp32" else 580) if ok else None
    return SweepRow(mode, batch, seconds if ok else None, peak if ok else None,
                    loss if ok else None, 3 if ok else 0, status, (), saved)


def _fake_probe(monkeypatch, fixed, step, out_of_memory_above=None):
    """_measure_one that takes ``fixed(b) + 2 * step(b)`` seconds of (fake) clock per row."""
    clock = [0.0]
    calls = []

    def fake_measure(model_fn, make_batch, mode, batch_size, device, steps, warmup, *rest):
        calls.append((mode, batch_size, steps, warmup))
        if out_of_memory_above is not None and batch_size > out_of_memory_above:
            raise torch.OutOfMemoryError("CUDA out of memory")
        clock[0] += fixed(batch_size) + (steps + warmup) * step(batch_size)
        return _row(mode, batch_size, seconds=step(batch_size))

    monkeypatch.setattr(P, "_measure_one", fake_measure)
    monkeypatch.setattr(P.time, "perf_counter", lambda: clock[0])
    return calls


def _estimate(**kwargs):
    args = dict(model_fn=lambda: None, make_batch=lambda b, d: None, modes=["fp32", "tf32", "bf16"],
                batch_sizes=[8, 16, 32], device="cpu", steps=2, warmup=1)
    args.update(kwargs)
    return estimate_sweep_seconds(**args)


def test_sweep_estimate_interpolates_fixed_cost_and_step_time_in_the_batch(monkeypatch):
    # A row costs 1 s to set up plus 0.01 s per example per step: small batches are not
    # a proportional share of a large one, which is what made a purely linear estimate low.
    calls = _fake_probe(monkeypatch, fixed=lambda b: 1.0, step=lambda b: 0.1 + 0.01 * b)
    seconds = _estimate(repeats=3)
    # tf32 cannot run on a CPU; fp32 and bf16 are probed at 32 (largest) and 8 (smallest).
    assert calls == [("fp32", 32, 1, 1), ("fp32", 8, 1, 1), ("bf16", 32, 1, 1), ("bf16", 8, 1, 1)]
    # The probe's warm-up step is part of its fixed cost: fixed = 1 + step.
    per_row = [(1.0 + (0.1 + 0.01 * b)) + (0 + 2) * (0.1 + 0.01 * b) for b in (8, 16, 32)]
    assert seconds == pytest.approx(2 * 3 * sum(per_row))


def test_sweep_estimate_probes_the_next_size_when_the_largest_does_not_fit(monkeypatch):
    calls = _fake_probe(monkeypatch, fixed=lambda b: 0.0, step=lambda b: 0.1,
                        out_of_memory_above=16)
    seconds = _estimate(modes=["fp32"], warmup=2)
    assert calls == [("fp32", 32, 1, 1), ("fp32", 16, 1, 1), ("fp32", 8, 1, 1)]
    # Rows 8 and 16 fit; 32 is a quick OOM. Each: fixed 0.1 (the probe's warm-up) + 3 steps.
    assert seconds == pytest.approx(2 * (0.1 + 3 * 0.1))


def test_sweep_estimate_measures_a_real_model_on_the_cpu():
    import math

    seconds = estimate_sweep_seconds(
        lambda: P.sweep_mlp(16, 32, 2), P.random_batch_maker((16,)), ["fp32"], [4, 8], "cpu",
        steps=2, warmup=1,
    )
    # (The first training step in a process pays one-off costs, seconds on a busy machine.)
    assert 0 < seconds and math.isfinite(seconds)


def test_sweep_estimate_refuses_what_the_sweep_refuses():
    with pytest.raises(ValueError, match="lr"):
        estimate_sweep_seconds(lambda: None, lambda b, d: None, ["fp32"], [4], "cpu",
                               lr=float("nan"))
