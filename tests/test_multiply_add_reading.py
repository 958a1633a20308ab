"""Chapter 2's timer comparison and the cache sizes its measurements are sized by."""

from pathlib import Path

import pytest

from d2lgpu.benchmarking import (
    TimerComparison,
    compare_timers,
    device_cache_bytes,
    last_level_cache_bytes,
)
from d2lgpu.timing import Timing


def test_timer_comparison_ratio_is_naive_over_synchronised_medians():
    comparison = TimerComparison("cpu", Timing((1.0, 3.0, 2.0)), Timing((4.0, 5.0, 4.0)))
    assert comparison.ratio == 2.0 / 4.0


def test_compare_timers_alternates_and_returns_both():
    calls = []
    result = compare_timers(lambda: calls.append(1), "cpu", warmup=2, repeats=3)
    assert len(calls) == 2 + 2 * 3
    assert len(result.naive.times) == len(result.synchronised.times) == 3
    assert result.device == "cpu" and result.ratio > 0


def test_compare_timers_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        compare_timers(lambda: None, "cpu", repeats=0)


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
