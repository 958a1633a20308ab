"""Tests of the course's clock: Timing, the rate arithmetic, tables and the timer's device."""

from __future__ import annotations

import pytest
import torch

from d2lgpu import timing as tm

# ----------------------------------------------------------------------------- Timing


def test_timing_statistics_match_an_independent_computation() -> None:
    times = [0.5, 0.1, 0.4, 0.2, 0.3, 0.9]
    timing = tm.Timing(tuple(times))
    as_tensor = torch.tensor(times, dtype=torch.float64)
    # torch.quantile interpolates linearly, the definition Timing documents.
    expected_iqr = (torch.quantile(as_tensor, 0.75) - torch.quantile(as_tensor, 0.25)).item()
    assert timing.median == pytest.approx((0.3 + 0.4) / 2)  # even count: mean of the middle two
    assert timing.min == 0.1
    assert timing.iqr == pytest.approx(expected_iqr)


def test_timing_of_known_list() -> None:
    # Sorted 1..5: the quartiles sit exactly on 2 and 4.
    timing = tm.Timing((5.0, 1.0, 4.0, 2.0, 3.0))
    assert timing.median == 3.0
    assert timing.iqr == pytest.approx(2.0)


def test_timing_single_measurement_has_no_spread() -> None:
    assert tm.Timing((0.25,)).iqr == 0.0


def test_timing_str_names_median_and_runs() -> None:
    text = str(tm.Timing((0.002, 0.002, 0.002)))
    assert text.startswith("median 2.00 ms") and "3 runs" in text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(1.5, "1.50 s"), (0.0032, "3.20 ms"), (41e-6, "41.0 us"), (5e-9, "5 ns")],
)
def test_format_seconds_picks_a_readable_unit(seconds: float, text: str) -> None:
    assert tm.format_seconds(seconds) == text


# ----------------------------------------------------------------------------- rates


def test_gbps_and_tflops_arithmetic() -> None:
    assert tm.gbps(2e9, 2.0) == pytest.approx(1.0)
    assert tm.gbps(0, 1.0) == 0.0
    assert tm.tflops(3e12, 1.5) == pytest.approx(2.0)


def test_format_table_aligns_columns() -> None:
    text = tm.format_table(["size", "GB/s"], [[1024, 1.23456], [4, 100.0]])
    lines = text.splitlines()
    assert lines[0].split() == ["size", "GB/s"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["1024", "1.23"]
    assert len({len(line) for line in lines}) == 1  # every line equally wide


# The ids avoid the bare word "gpu", which the GPU-marker hook would take for a marker.
@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:-"], ids=["word", "index", "sign"])
def test_malformed_device_string_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="not a device PyTorch understands"):
        tm.timing_device(bad)


def test_devices_that_do_no_work_are_rejected() -> None:
    with pytest.raises(ValueError, match="meta"):
        tm.timing_device("meta")
    with pytest.raises(TypeError):
        tm.timing_device(True)


def test_timing_device_keeps_cpu_and_none() -> None:
    assert tm.timing_device("cpu") == torch.device("cpu")
    assert tm.timing_device(torch.device("cpu")) == torch.device("cpu")
    assert tm.timing_device(None) is None


@pytest.mark.parametrize(("call", "match"), [
    (lambda: tm.time_fn(lambda: None, repeats=0), "repeats must be an int"),
    (lambda: tm.format_table(["a", "b"], [[1]]), "list of 2 values"),
])
def test_timing_names_the_fix_for_bad_input(call, match) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_timed_calls_times_each_call_without_a_warm_up():
    from d2lgpu.timing import timed_calls

    calls = []
    timing = timed_calls(lambda: calls.append(1), None, 3)
    assert len(calls) == 3 and len(timing.times) == 3 and all(t >= 0 for t in timing.times)
