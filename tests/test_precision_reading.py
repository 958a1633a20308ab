"""Tests of the helpers that read a precision sweep: format table, checks, headline, estimate."""

import pytest
import torch

import d2lgpu.precision as P
from d2lgpu.precision import (
    SweepComparison,
    SweepRow,
    estimate_sweep_seconds,
    explain_comparison,
    sweep_checks,
)


def _flat(text):
    """The headline without its line wrapping."""
    return " ".join(text.split())


def _row(mode, batch, seconds=0.01, peak=None, loss=2.3, status="ok"):
    ok = status == "ok"
    saved = (1000 if mode == "fp32" else 580) if ok else None
    return SweepRow(mode, batch, seconds if ok else None, peak if ok else None,
                    loss if ok else None, 3 if ok else 0, status, (), saved)


def test_sweep_checks_pass_for_a_sound_cpu_sweep_and_name_what_breaks():
    modes, sizes = ["fp32", "tf32", "bf16"], [8, 16]
    rows = [_row("fp32", 8), _row("fp32", 16), _row("tf32", 8, status="needs CUDA"),
            _row("tf32", 16, status="needs CUDA"), _row("bf16", 8, loss=2.31),
            _row("bf16", 16, status="OOM")]
    assert all(sweep_checks(rows, modes, sizes, "cpu").values())

    diverged = rows[:4] + [_row("bf16", 8, loss=float("nan")), rows[5]]
    checks = sweep_checks(diverged, modes, sizes, "cpu")
    assert not checks["reduced-precision losses within 0.1 of fp32"]
    assert checks["one row per mode and batch size"]

    assert not sweep_checks(rows[::-1], modes, sizes, "cpu")["one row per mode and batch size"]
    assert not sweep_checks(rows, modes, sizes, "cuda")["peak memory measured exactly when on CUDA"]
    assert checks_hold_for_saved_bytes(rows, modes, sizes)
    only_fp32 = [r for r in rows if r.mode == "fp32"]
    checks = sweep_checks(only_fp32, ["fp32"], sizes, "cpu")
    assert not checks["reduced precision compared with fp32 at least once"]


def checks_hold_for_saved_bytes(rows, modes, sizes):
    """Rows without saved-byte counts fail that check; with counts, bf16 must save fewer."""
    names = ("bytes saved for the backward pass counted for every row that ran",
             "reduced precision saves fewer bytes than fp32 at the largest batch")
    uncounted = [SweepRow(r.mode, r.batch_size, r.median_seconds, None, r.loss, r.steps_run,
                          r.status) for r in rows]
    assert not sweep_checks(uncounted, modes, sizes, "cpu")[names[0]]
    counted = rows
    checks = sweep_checks(counted, modes, sizes, "cpu")
    assert checks[names[0]] and checks[names[1]]
    more = [SweepRow(r.mode, r.batch_size, r.median_seconds, None, r.loss, r.steps_run, r.status,
                     (), r.saved_activation_bytes and (1000 if r.mode == "fp32" else 1200))
            for r in counted]
    assert not sweep_checks(more, modes, sizes, "cpu")[names[1]]
    # More at a small batch (autocast's weight copies) but fewer at the largest: that holds.
    both = [SweepRow("fp32", 8, 0.01, None, 2.3, 3, "ok", (), 1000),
            SweepRow("fp32", 16, 0.01, None, 2.3, 3, "ok", (), 2000),
            SweepRow("bf16", 8, 0.01, None, 2.3, 3, "ok", (), 1200),
            SweepRow("bf16", 16, 0.01, None, 2.3, 3, "ok", (), 1700)]
    assert sweep_checks(both, ["fp32", "bf16"], [8, 16], "cpu")[names[1]]
    both[3] = SweepRow("bf16", 16, 0.01, None, 2.3, 3, "ok", (), 2100)
    assert not sweep_checks(both, ["fp32", "bf16"], [8, 16], "cpu")[names[1]]
    return True


def test_a_cpu_slow_down_is_stated_as_one_with_its_reason():
    slower = SweepComparison("fp32", "bf16", 1024, 0.35, None, (0.34, 0.35, 0.37))
    assert slower.verdict == "slower"
    text = explain_comparison(slower, "cpu", cpu_native_bf16=False)
    assert ("bf16 ran 2.86x slower than fp32 at batch 1024 (median of 3 paired repeats, 0.34x to "
            "0.37x; step time of fp32 over bf16)") in _flat(text)
    assert "speed-up" not in text and "no bf16 instructions" in text
    assert all(len(line) <= 100 for line in text.splitlines())
    assert "automatic choice here is fp32" in _flat(text)


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_headline_follows_the_measurement_on_both_kinds_of_cpu(native):
    # The same words must be true whichever way the measurement came out, on either CPU.
    faster = SweepComparison("fp32", "bf16", 64, 2.5, None, (2.4, 2.5, 2.7))
    slower = SweepComparison("fp32", "bf16", 64, 0.5, None, (0.4, 0.5, 0.6))
    fast_text = _flat(explain_comparison(faster, "cpu", native))
    slow_text = _flat(explain_comparison(slower, "cpu", native))
    assert "2.50x as fast" in fast_text and "2.00x slower" in slow_text
    auto = "bf16" if native else "fp32"
    for text in (fast_text, slow_text):
        assert f"automatic choice here is {auto}." in text
        assert ("has bf16 instructions" in text) is native
    if native:
        assert "did not pay" in slow_text and "did not pay" not in fast_text
    else:
        assert "bf16 still won" in fast_text and "still won" not in slow_text


@pytest.mark.parametrize(
    ("ratios", "verdict"),
    [
        ((2.0, 2.1, 1.9), "faster"),
        ((1.12, 1.15, 1.11), "faster"),  # median 1.12: just above 1.10
        ((1.08, 1.09, 1.05), "same speed"),  # median 1.08: just below 1.10
        ((0.92, 0.93, 0.95), "same speed"),  # median 0.93: above 1 / 1.10 = 0.909
        ((0.89, 0.90, 0.88), "slower"),  # median 0.89: below 0.909
        ((0.5, 0.6, 0.55), "slower"),
        ((0.8, 1.3, 1.1), "same speed"),
        ((3.0, 0.2, 2.5, 2.8, 0.4), "faster"),  # two disturbed pairs out of five: median 2.5
        ((3.0, 3.0), "too few repeats"),
        ((), "too few repeats"),
    ],
)
def test_the_speed_verdict_goes_by_the_median_of_the_paired_ratios(ratios, verdict):
    assert P.speed_verdict(ratios) == verdict
    comparison = SweepComparison("fp32", "bf16", 64, 1.0, None, ratios)
    assert comparison.verdict == verdict
    text = _flat(explain_comparison(comparison, "cuda"))
    if verdict in ("faster", "slower"):
        ratio = comparison.paired_speedup
        assert f"bf16 ran {ratio if verdict == 'faster' else 1 / ratio:.2f}x" in text
    elif verdict == "same speed":
        assert "ran as fast as fp32 at batch 64, within 10%" in text
    else:
        assert "a speed verdict takes 3 or more" in text
    for hedge in ("too wide", "run it again", "quiet machine", "cannot tell", "no verdict"):
        assert hedge not in text


def test_the_speed_verdict_threshold_and_repeats_can_be_set_and_are_checked():
    assert P.speed_verdict((1.3, 1.3, 1.3), tolerance=0.5) == "same speed"
    assert P.speed_verdict((1.6, 1.6, 1.6), tolerance=0.5) == "faster"
    assert P.speed_verdict((2.0,), min_repeats=1) == "faster"
    with pytest.raises(ValueError, match="finite and positive"):
        P.speed_verdict((1.0, float("nan"), 1.0))
    with pytest.raises(ValueError, match="finite and positive"):
        P.speed_verdict((1.0, -1.0, 1.0))
    with pytest.raises(TypeError):
        P.speed_verdict("fast")


def test_a_gpu_comparison_reports_speed_and_memory():
    comparison = SweepComparison("fp32", "bf16", 4096, 3.0, 0.55, (3.0,) * 3)
    text = _flat(explain_comparison(comparison, "cuda"))
    assert text == ("bf16 ran 3.00x as fast as fp32 at batch 4096 (median of 3 paired repeats, "
                    "3.00x to 3.00x; step time of fp32 over bf16). Memory: bf16 used 45% less "
                    "peak memory than fp32.")
    with_saved = SweepComparison("fp32", "bf16", 64, 1.5, None, (1.5,) * 3, saved_ratio=0.58)
    assert _flat(explain_comparison(with_saved, "cpu", True)).startswith(
        "bf16 ran 1.50x as fast as fp32 at batch 64 (median of 3 paired repeats, 1.50x to 1.50x; "
        "step time of fp32 over bf16). Memory: bf16 used 42% fewer bytes saved for the backward "
        "pass than fp32.")
    small = explain_comparison(SweepComparison("fp32", "fp16", 16, 0.9, 1.0, (0.9,) * 3), "cuda")
    assert "slower" in small and "kernel launches" in small
    assert "nothing to compare" in explain_comparison(None, "cpu")


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [(("not a comparison", "cpu"), TypeError, "compare_sweep_modes"),
     ((None, "gpu0"), ValueError, "not a device"),
     ((None, "cpu", "yes"), TypeError, "cpu_native_bf16")],
)
def test_explain_comparison_refuses_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        explain_comparison(*args)


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
