"""The arithmetic of benchmarks/full_mode_estimate.py, on made-up workloads."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "full_mode_estimate.py"
_spec = importlib.util.spec_from_file_location("full_mode_estimate", _PATH)
fme = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fme  # dataclasses look their module up while the file runs
_spec.loader.exec_module(fme)


def test_time_is_flops_over_peak_times_utilisation_plus_overhead():
    # 1 PFLOP at 50 TFLOP/s and 40 %: 1e15 / 2e13 = 50 s, plus 30 s.
    assert fme.estimate_seconds(1e15, 50.0, 0.4, 30.0) == pytest.approx(80.0)
    # Halving the utilisation doubles the compute part, not the overhead.
    assert fme.estimate_seconds(1e15, 50.0, 0.2, 30.0) == pytest.approx(130.0)
    assert fme.estimate_seconds(0.0, 50.0, 0.2, 30.0) == pytest.approx(30.0)


@pytest.mark.parametrize("bad", [dict(peak_tflops=0.0), dict(utilisation=0.0),
                                 dict(utilisation=1.5), dict(flops=-1.0),
                                 dict(overhead_s=-1.0)])
def test_estimate_refuses_impossible_inputs(bad):
    args = dict(flops=1e12, peak_tflops=10.0, utilisation=0.5, overhead_s=0.0) | bad
    with pytest.raises(ValueError):
        fme.estimate_seconds(**args)


def test_a_made_up_training_workload_follows_the_rule(monkeypatch):
    # A model of known cost is stubbed in, so only the arithmetic is under test.
    cost = fme.StepCost(flops_per_example=1e9, ops_per_step=10,
                        activation_bytes_per_example=1e6, parameter_bytes=1_000_000)
    monkeypatch.setattr(fme, "step_cost", lambda model, shape: cost)
    work = fme.Train("made up", "made up", (1, 28, 28), examples=10_000, batch=100,
                     epochs=2, runs=3, precision="fp16", kind="conv")
    got = work.cost(fme.T4)
    flops = 3 * 2 * 10_000 * 1e9  # runs x epochs x examples x FLOPs per example
    utilisation = fme.UTILISATION[("T4", "fp16", "conv")]
    assert got.gpu_flops == pytest.approx(flops)
    assert got.seconds == pytest.approx(fme.estimate_seconds(flops, 65.0, utilisation, 0.0))
    assert got.at_peak == pytest.approx(flops / 65e12)
    assert got.seconds > got.at_peak  # the assumed utilisation is below 1
    # 600 steps x 10 launches x 20 us = 0.12 s of host time: far below the GPU's 9 s.
    assert got.note == "GPU-bound"


def test_a_chapter_adds_its_fixed_overhead_once():
    chapter = fme.Chapter(99, "made up", (fme.Fixed("sleep", seconds=7.0),
                                          fme.Matmuls("matmuls", 8.1e12, 10)))
    t4 = fme.estimate_chapter(chapter, fme.T4)
    compute = fme.estimate_seconds(8.1e13, 8.1, fme.UTILISATION[("T4", "fp32", "gemm")], 0.0)
    assert t4.seconds == pytest.approx(fme.T4.overhead_s + 7.0 + compute)
    assert t4.at_peak == pytest.approx(10.0)  # 8.1e13 FLOPs at 8.1 TFLOP/s


def test_memory_bound_work_divides_bytes_by_bandwidth():
    got = fme.Traffic("copies", nbytes=320e9, repeats=2).cost(fme.T4)
    assert got.at_peak == pytest.approx(2.0)  # 640 GB at 320 GB/s
    assert got.seconds == pytest.approx(2.0 / fme.BANDWIDTH_SHARE)


def test_fits_is_decided_by_the_30_minute_budget():
    assert fme.fits(30 * 60) == "yes"
    assert fme.fits(30 * 60 + 1) == "no"


def test_every_chapter_has_an_entry_with_workloads():
    numbers = [chapter.number for chapter in fme.CHAPTERS]
    assert numbers == list(range(1, 10))
    assert all(chapter.workloads and chapter.dominant for chapter in fme.CHAPTERS)


def test_data_sheet_peaks_match_the_package():
    from d2lgpu import chips

    assert fme.T4.peak("fp16") == chips.PEAK_TFLOPS[("t4", None)][0]
    assert fme.H100.peak("bf16") == chips.PEAK_TFLOPS[("h100", "sxm5")][0]
    assert f"{fme.H100.gbps:.0f} GB/s" == chips.GPU_DATASHEETS["H100 SXM5"]["memory bandwidth"]
    assert f"{fme.T4.gbps:.0f} GB/s" == chips.GPU_DATASHEETS["T4"]["memory bandwidth"]
    # autocast's fast format: fp16 on a T4 (no native bf16), bf16 on an H100
    assert (fme.T4.amp, fme.H100.amp) == ("fp16", "bf16")


def test_out_of_memory_rows_cost_one_attempt(monkeypatch):
    cost = fme.StepCost(flops_per_example=1e9, ops_per_step=10,
                        activation_bytes_per_example=2**30, parameter_bytes=0)
    monkeypatch.setattr(fme, "step_cost", lambda model, shape: cost)
    # 1 GiB per example x 64 x 1.5 does not fit 14.7 GiB; x 32 x 1.5 fits 79.1 GiB
    t4 = fme.Train("big", "big", (1, 8, 8), 64, 64, runs=39, check_memory=True).cost(fme.T4)
    h100 = fme.Train("small", "small", (1, 8, 8), 32, 32, runs=39,
                     check_memory=True).cost(fme.H100)
    assert t4.seconds == fme.OOM_SECONDS and "out of memory" in t4.note
    assert math.isclose(h100.gpu_flops, 39 * 32 * 1e9)
