"""Tests of the helpers that read a precision sweep: format table, checks, headline, estimate."""

import pytest
import torch

import d2lgpu.precision as P
from d2lgpu.precision import (
    SweepComparison,
    SweepRow,
    estimate_sweep_seconds,
    explain_comparison,
    narrow_tensor_core_formats,
    native_tensor_core_formats,
    sweep_checks,
)


def _row(mode, batch, seconds=0.01, peak=None, loss=2.3, status="ok"):
    ok = status == "ok"
    return SweepRow(mode, batch, seconds if ok else None, peak if ok else None,
                    loss if ok else None, 3 if ok else 0, status)


@pytest.mark.parametrize(
    ("capability", "narrow"),
    [((6, 0), []), ((6, 1), []), ((7, 0), []), ((7, 5), ["int8"]), ((8, 0), ["int8"]),
     ((8, 6), ["int8"]), ((8, 9), ["fp8", "int8"]), ((9, 0), ["fp8", "int8"]),
     ((10, 0), ["fp8", "fp6", "fp4", "int8"]), ((12, 0), ["fp8", "fp6", "fp4", "int8"])],
)
def test_narrow_formats_per_generation(capability, narrow):
    assert narrow_tensor_core_formats(capability) == narrow


def test_h100_and_l4_differ_from_a100_by_fp8_only():
    a100, l4, h100 = (8, 0), (8, 9), (9, 0)
    assert native_tensor_core_formats(a100) == native_tensor_core_formats(h100)
    assert "fp8" not in narrow_tensor_core_formats(a100)
    assert "fp8" in narrow_tensor_core_formats(l4) and "fp8" in narrow_tensor_core_formats(h100)


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
    only_fp32 = [r for r in rows if r.mode == "fp32"]
    checks = sweep_checks(only_fp32, ["fp32"], sizes, "cpu")
    assert not checks["reduced precision compared with fp32 at least once"]


def test_a_cpu_slow_down_is_stated_as_one_with_its_reason():
    slower = SweepComparison("fp32", "bf16", 1024, 0.35, None)
    text = explain_comparison(slower, "cpu", cpu_native_bf16=False)
    assert "bf16 ran 2.86x slower than fp32 at batch 1024" in text
    assert "speed-up" not in text and "no native bf16" in text
    assert all(len(line) <= 100 for line in text.splitlines())

    native = explain_comparison(SweepComparison("fp32", "bf16", 64, 2.5, None), "cpu", True)
    assert "2.50x as fast" in native and "natively" in native


def test_a_gpu_comparison_reports_speed_and_memory():
    text = explain_comparison(SweepComparison("fp32", "bf16", 4096, 3.0, 0.55), "cuda")
    assert text == "bf16 ran 3.00x as fast as fp32 at batch 4096, with 45% less peak memory."
    small = explain_comparison(SweepComparison("fp32", "fp16", 16, 0.9, 1.0), "cuda")
    assert "slower" in small and "kernel launches" in small
    assert "nothing to compare" in explain_comparison(None, "cpu")


def test_sweep_estimate_scales_one_timed_step_by_batch_and_steps(monkeypatch):
    calls = []

    def fake_measure(model_fn, make_batch, mode, batch_size, device, steps, warmup, *rest):
        calls.append((mode, batch_size, steps, warmup))
        if batch_size > 16:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return _row(mode, batch_size, seconds=0.1)

    monkeypatch.setattr(P, "_measure_one", fake_measure)
    seconds = estimate_sweep_seconds(
        None, None, ["fp32", "tf32", "bf16"], [8, 16, 32], "cpu", steps=2, warmup=1
    )
    # tf32 cannot run on a CPU; fp32 and bf16 fit at 16 (32 is out of memory): per mode
    # rows 8 and 16 cost (1 + 2) steps of 0.1 s scaled by 8/16 and 16/16.
    assert seconds == pytest.approx(2 * 3 * 0.1 * (8 + 16) / 16)
    assert calls == [("fp32", 32, 1, 1), ("fp32", 16, 1, 1), ("bf16", 32, 1, 1),
                     ("bf16", 16, 1, 1)]


def test_sweep_estimate_measures_a_real_model_on_the_cpu():
    seconds = estimate_sweep_seconds(
        lambda: P.sweep_mlp(16, 32, 2), P.random_batch_maker((16,)), ["fp32"], [4, 8], "cpu",
        steps=2, warmup=1,
    )
    assert 0 < seconds < 5
