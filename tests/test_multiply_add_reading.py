"""Chapter 2's reading of its measurements: timer comparison, sweep findings and plot."""

import matplotlib

matplotlib.use("Agg")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from d2lgpu import benchmarking as bm  # noqa: E402
from d2lgpu.benchmarking import (  # noqa: E402
    ElementwiseRow,
    TimerComparison,
    compare_timers,
    device_cache_bytes,
    last_level_cache_bytes,
    multiply_add_findings,
    plot_multiply_add,
)
from d2lgpu.timing import Timing  # noqa: E402


def _comparison(device: str, naive: float, synced: float) -> TimerComparison:
    return TimerComparison(device, Timing((naive,)), Timing((synced,)))


def test_timers_that_agree_on_the_cpu_are_said_to_agree():
    verdict = _comparison("cpu", 1.05e-3, 1.0e-3).verdict()
    assert verdict.startswith("cpu: the two timers agree to within 5%")


def test_timers_that_differ_on_the_cpu_are_called_noise_not_agreement():
    verdict = _comparison("cpu", 2.69e-3, 1.0e-3).verdict()
    assert "differ by a factor of 2.69" in verdict and "other programs held the cores" in verdict
    assert "agree" not in verdict


def test_naive_timer_on_a_gpu_sees_a_fraction():
    assert "saw 3% of the real time" in _comparison("cuda:0", 3e-5, 1e-3).verdict()
    assert "queuing the kernels takes about as long" in _comparison(
        "cuda:0", 0.9e-4, 1e-4
    ).verdict()


def test_compare_timers_alternates_and_returns_both():
    calls = []
    result = compare_timers(lambda: calls.append(1), "cpu", warmup=2, repeats=3)
    assert len(calls) == 2 + 2 * 3
    assert len(result.naive.times) == len(result.synchronised.times) == 3
    assert result.device == "cpu" and result.ratio > 0


def test_compare_timers_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        compare_timers(lambda: None, "cpu", repeats=0)


def _row(device, variant, numel, seconds, share):
    return ElementwiseRow(device=device, variant=variant, numel=numel, steps=1,
                          seconds=seconds, gbps=10 * share, share_of_copy_peak=share)


def test_findings_explain_rows_above_the_copy_bandwidth_by_the_caches():
    rows = [_row("cpu", "unfused", 2**16, 1.5e-5, 2.1), _row("cpu", "fused", 2**16, 1e-5, 3.4),
            _row("cpu", "unfused", 2**24, 3e-2, 0.6), _row("cpu", "fused", 2**24, 2e-2, 0.6)]
    findings = multiply_add_findings(rows, {"cpu": 10.0})
    assert findings[0].startswith("cpu: 2 of 4 rows beat the copy bandwidth of 10 GB/s "
                                  "(up to 340 % at 65,536 floats)")
    assert "at most 1.25 MiB" in findings[0] and "fit in the caches" in findings[0]
    assert "which rows fit is left open" in findings[0]
    with_cache = multiply_add_findings(rows, {"cpu": 10.0}, {"cpu": 32 * 2**20})[0]
    assert "All of them keep their tensors (at most 1.25 MiB) within the 32 MiB cache" in with_cache
    assert findings[1] == ("cpu: at 16,777,216 floats, unfused 60 %, fused 60 % of the copy "
                           "bandwidth.")
    assert "fused is 1.50x as fast as unfused there, close to the 1.5x" in findings[2]
    assert findings[-1].startswith("Only the CPU ran")


def test_findings_say_when_nothing_beats_the_copy_bandwidth():
    rows = [_row("cpu", "unfused", 2**24, 6e-2, 0.3), _row("cpu", "fused", 2**24, 1e-2, 0.9)]
    findings = multiply_add_findings(rows, {"cpu": 10.0})
    assert "no row beats the copy bandwidth" in findings[0]
    assert "6.00x as fast as unfused there, more than the 1.5x" in findings[2]
    assert "allocates" in findings[2]


def test_findings_say_when_fusing_gains_less_than_the_bytes():
    rows = [_row("cpu", "unfused", 2**24, 1.05e-2, 0.5), _row("cpu", "fused", 2**24, 1e-2, 0.5)]
    assert "less than the 1.5x" in multiply_add_findings(rows, {"cpu": 10.0})[2]


def test_findings_compare_a_gpu_with_the_cpu():
    rows = [_row("cpu", "fused", 2**24, 2e-2, 0.8), _row("cuda:0", "fused", 2**24, 1e-3, 0.9)]
    findings = multiply_add_findings(rows, {"cpu": 20.0, "cuda:0": 400.0})
    assert findings[-1] == ("cuda:0: 20.0x as fast as the CPU at 16,777,216 floats (fused); "
                            "its copy bandwidth is 20.0x the CPU's.")
    assert not any(f.startswith("Only the CPU") for f in findings)


def test_findings_need_rows():
    with pytest.raises(ValueError, match="multiply_add_sweep"):
        multiply_add_findings([], {})


def test_plot_keeps_every_line_visible():
    rows = [_row("cpu", v, n, t, 1.0) for v, t in [("unfused", 1.5), ("fused", 1.0)]
            for n in (2**10, 2**20)]
    fig = plot_multiply_add(rows, {"cpu": 10.0})
    ax_gbps, ax_gain = fig.axes
    data_lines = [line for line in ax_gbps.get_lines() if len(line.get_xdata()) > 2 or
                  line.get_marker() not in ("None", None, "")]
    styles = {(line.get_marker(), line.get_linestyle()) for line in data_lines}
    assert len(styles) == len(data_lines) == 2  # same numbers, still two distinct lines
    (gain,) = [line for line in ax_gain.get_lines() if line.get_marker() == "s"]
    assert list(gain.get_ydata()) == pytest.approx([1.5, 1.5])
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.fixture(params=[True, False], ids=["x86-write-allocate", "no-write-allocate"])
def writes_allocate(request, monkeypatch):
    monkeypatch.setattr(bm, "cpu_writes_allocate", lambda: request.param)
    return request.param


def test_copy_peak_ceilings_follow_the_bytes(writes_allocate):
    ceiling = {v: bm.copy_peak_ceiling("cpu", v) for v in ("fused", "unfused", "compiled")}
    if writes_allocate:  # the copy moves 3 sizes, counted as 2
        assert ceiling == pytest.approx({"fused": 1.5, "unfused": 1.125, "compiled": 1.2})
    else:
        assert set(ceiling.values()) == {1.0}
    assert bm.copy_peak_ceiling("cuda:0", "fused") == 1.0
    assert bm.copy_peak_ceiling("cpu", "something else") == 1.0


def test_findings_tell_cache_from_a_disturbed_measurement(writes_allocate):
    rows = [_row("cpu", "fused", 2**16, 1e-5, 3.4), _row("cpu", "unfused", 2**16, 1.5e-5, 2.1),
            _row("cpu", "fused", 2**24, 1e-2, 1.6), _row("cpu", "unfused", 2**24, 5e-2, 0.3)]
    findings = multiply_add_findings(rows, {"cpu": 10.0}, {"cpu": 32 * 2**20})
    fits, spills = findings[0], findings[1]
    assert fits.startswith("cpu: 3 of 4 rows beat the copy bandwidth")
    assert "2 of them keep their tensors (at most 1.25 MiB) within the 32 MiB cache" in fits
    assert spills.startswith("cpu: 1 of them (16,777,216 floats fused) do so")
    assert "other programs held the cores" in spills and "cache, which is faster" not in spills
    assert ("above what write-allocate allows" in spills) == writes_allocate


def test_findings_explain_write_allocate_instead_of_calling_it_disturbed(writes_allocate):
    # fused at 130 % and unfused at 110 % with tensors beyond the cache: within the ceilings
    rows = [_row("cpu", "fused", 2**24, 1e-2, 1.3), _row("cpu", "unfused", 2**24, 2e-2, 1.1)]
    first, *rest = multiply_add_findings(rows, {"cpu": 10.0}, {"cpu": 32 * 2**20})
    assert first.startswith("cpu: 2 of 2 rows beat the copy bandwidth of 10 GB/s")
    if writes_allocate:
        assert "write-allocate" in first and "other programs" not in first
        assert "fused at 130 % (ceiling 150.0 %)" in first
        assert "unfused at 110 % (ceiling 112.5 %)" in first
        assert not any("other programs" in f for f in rest)
    else:
        assert "other programs held the cores" in first and "write-allocate" not in first


def test_findings_with_only_rows_too_large_for_the_cache_blame_the_measurement(writes_allocate):
    rows = [_row("cpu", "fused", 2**24, 1e-2, 1.7)]  # above even the write-allocate ceiling
    (first, *_) = multiply_add_findings(rows, {"cpu": 10.0}, {"cpu": 32 * 2**20})
    assert first.startswith("cpu: 1 of 1 rows beat the copy bandwidth of 10 GB/s")
    assert "exceed the 32 MiB cache" in first and "within" not in first
    assert "other programs held the cores" in first


def test_last_level_cache_of_the_cpu():
    size = device_cache_bytes("cpu")
    if Path("/sys/devices/system/cpu/cpu0/cache/index0/size").exists():
        assert size is not None and size >= 2**16  # at least 64 KiB: every cache level counts
    found = last_level_cache_bytes()
    assert size == (None if found is None else found[0])


@pytest.mark.gpu
def test_last_level_cache_of_a_gpu_is_its_l2():
    import torch

    assert device_cache_bytes("cuda:0") == torch.cuda.get_device_properties(0).L2_cache_size


def test_findings_flag_rows_slower_than_a_larger_size():
    rows = [_row("cpu", "fused", 2**16, 0.172, 0.01), _row("cpu", "fused", 2**18, 5.46e-4, 10.4),
            _row("cpu", "unfused", 2**16, 1e-4, 0.5), _row("cpu", "unfused", 2**18, 4e-4, 0.5)]
    findings = multiply_add_findings(rows, {"cpu": 10.0}, {"cpu": 32 * 2**20})
    (odd,) = [f for f in findings if "more than twice as long" in f]
    assert odd.startswith("cpu: 1 row(s) took more than twice as long as a larger size of the "
                          "same variant (e.g. 65,536 floats fused: 172.00 ms, against 546.0 us "
                          "for 262,144)")


def test_findings_on_a_quiet_sweep_flag_nothing():
    rows = [_row("cpu", "fused", 2**16, 1e-4, 0.5), _row("cpu", "fused", 2**18, 4e-4, 0.5)]
    findings = multiply_add_findings(rows, {"cpu": 10.0})
    assert not any("more than twice as long" in f for f in findings)
