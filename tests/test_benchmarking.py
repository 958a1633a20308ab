"""Tests of chapter 2's timers (beside the course's own, time_fn) and measurements."""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from d2lgpu import benchmarking as bm
from d2lgpu import timing as tm

# ----------------------------------------------------------------------------- timers


class CallCounter:
    """A callable that records how often it was called and sleeps a little."""

    def __init__(self, sleep: float = 0.0) -> None:
        self.calls = 0
        self.sleep = sleep

    def __call__(self) -> None:
        self.calls += 1
        if self.sleep:
            time.sleep(self.sleep)


@pytest.mark.parametrize("timer", [tm.time_fn, bm.time_naive])
def test_timers_call_fn_warmup_plus_repeats_times(timer) -> None:
    fn = CallCounter()
    timing = timer(fn, "cpu", warmup=3, repeats=7)
    assert fn.calls == 10
    assert len(timing.times) == 7


@pytest.mark.parametrize("timer", [tm.time_fn, bm.time_naive])
def test_timers_measure_at_least_the_work_on_cpu(timer) -> None:
    # time.sleep sleeps at least as long as asked, so no run can be shorter.
    timing = timer(CallCounter(sleep=0.005), None, warmup=0, repeats=3)
    assert timing.min >= 0.005


@pytest.mark.parametrize("timer", [tm.time_fn, bm.time_naive])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"repeats": 0}, "repeats"),
        ({"repeats": -3}, "repeats"),
        ({"repeats": 2.5}, "repeats"),
        ({"repeats": True}, "repeats"),
        ({"warmup": -1}, "warmup"),
    ],
)
def test_timers_reject_bad_counts(timer, kwargs: dict, match: str) -> None:
    fn = CallCounter()
    with pytest.raises(ValueError, match=match):
        timer(fn, "cpu", **kwargs)
    assert fn.calls == 0  # rejected before doing any work


def test_missing_gpu_is_a_clear_error() -> None:
    # cuda:7 does not exist here: either there is no CUDA at all, or fewer GPUs.
    with pytest.raises(RuntimeError, match="cannot use CUDA|does not exist"):
        tm.time_fn(CallCounter(), "cuda:7")


class FakeCuda:
    """Four visible GPUs, the current one 2, and a record of every synchronisation."""

    def __init__(self, monkeypatch) -> None:
        self.synchronized: list[object] = []
        self.current = 2
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "device", self.device)
        if hasattr(torch, "accelerator"):  # newer torch's Timer synchronises through it
            monkeypatch.setattr(torch.accelerator, "synchronize", self.synchronize)

    def synchronize(self, device=None) -> None:
        if device is None:
            self.synchronized.append(self.current)
        else:
            self.synchronized.append(device if isinstance(device, int) else device.index)

    @contextlib.contextmanager
    def device(self, device):
        before, self.current = self.current, device.index
        try:
            yield
        finally:
            self.current = before


@pytest.mark.parametrize("timer", [tm.time_fn, bm.time_naive])
def test_timers_without_a_device_synchronise_only_the_current_gpu(monkeypatch, timer) -> None:
    # Waiting for every visible GPU would create a CUDA context on each of them, on a
    # shared server too; the timed function runs on the current device.
    cuda = FakeCuda(monkeypatch)
    timer(CallCounter(), None, warmup=0, repeats=3)
    assert cuda.synchronized and set(cuda.synchronized) == {2}


@pytest.mark.parametrize("timer", [tm.time_fn, bm.time_naive])
def test_timers_synchronise_the_device_they_are_given(monkeypatch, timer) -> None:
    cuda = FakeCuda(monkeypatch)
    timer(CallCounter(), "cuda:1", warmup=0, repeats=3)
    assert cuda.synchronized and set(cuda.synchronized) == {1}


# ----------------------------------------------------------------------------- bandwidth


class ByteCounter(TorchDispatchMode):
    """Adds up the bytes every aten op reads (tensor inputs) and writes (tensor outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors_in = [a for a in args if isinstance(a, torch.Tensor)]
        tensors_out = out if isinstance(out, tuple | list) else [out]
        self.read += sum(t.numel() * t.element_size() for t in tensors_in)
        self.written += sum(
            t.numel() * t.element_size() for t in tensors_out if isinstance(t, torch.Tensor)
        )
        return out


@pytest.mark.parametrize(
    ("step", "passes"),
    [
        (bm.multiply_add_unfused, bm.UNFUSED_TENSOR_PASSES),
        (bm.multiply_add_fused, bm.FUSED_TENSOR_PASSES),
    ],
)
def test_tensor_passes_match_what_the_ops_touch(step, passes: int) -> None:
    numel, steps = 1000, 3
    a, b = torch.randn(numel), torch.randn(numel)
    result = torch.zeros(numel)
    counter = ByteCounter()
    with counter:
        for _ in range(steps):
            result = step(result, a, b)
    assert counter.read + counter.written == bm.multiply_add_bytes(numel, 4, steps, passes)
    assert bm.multiply_add_bytes(numel, 4, steps, passes) == passes * numel * 4 * steps


@pytest.mark.parametrize("step", [bm.multiply_add_unfused, bm.multiply_add_fused])
def test_multiply_add_loop_computes_steps_times_a_times_b(step) -> None:
    a, b = torch.randn(100), torch.randn(100)
    result = bm.run_multiply_add(step, a, b, steps=5)
    torch.testing.assert_close(result, 5 * a * b)


def test_multiply_add_benchmark_row_is_self_consistent() -> None:
    row = bm.multiply_add_benchmark(
        "cpu",
        4096,
        steps=3,
        step=bm.multiply_add_fused,
        tensor_passes=bm.FUSED_TENSOR_PASSES,
        copy_gbps=10.0,
        variant="fused",
        repeats=2,
    )
    assert (row.device, row.variant, row.numel, row.steps) == ("cpu", "fused", 4096, 3)
    assert row.gbps == pytest.approx(4 * 4096 * 4 * 3 / row.seconds / 1e9)
    assert row.share_of_copy_peak == pytest.approx(row.gbps / 10.0)


def test_copy_bandwidth_on_cpu_is_a_positive_rate() -> None:
    rate = bm.measure_copy_bandwidth("cpu", 2**20, warmup=1, repeats=3)
    assert math.isfinite(rate) and rate > 0


def test_copy_bandwidth_rejects_bad_sizes_and_no_device() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        bm.measure_copy_bandwidth("cpu", 2)
    with pytest.raises(ValueError, match="needs a device"):
        bm.measure_copy_bandwidth(None)


def _fake_cpu_caches(root, caches) -> None:
    """A /sys/devices/system/cpu/cpu0/cache tree: (level, type, size, shared_cpu_list) each."""
    for i, (level, kind, size, shared) in enumerate(caches):
        index = root / f"index{i}"
        index.mkdir(parents=True)
        for name, value in [("level", level), ("type", kind), ("size", size),
                            ("shared_cpu_list", shared)]:
            (index / name).write_text(f"{value}\n")


def test_last_level_cache_is_read_from_sysfs_and_counts_every_instance(tmp_path, monkeypatch):
    _fake_cpu_caches(tmp_path, [(1, "Data", "32K", "0"), (1, "Instruction", "32K", "0"),
                                (2, "Unified", "1024K", "0"), (3, "Unified", "32M", "0-7")])
    monkeypatch.setattr(bm, "_CPU0_CACHE_DIR", tmp_path)
    monkeypatch.setattr(bm, "_usable_cpus", lambda: 8)
    size, where = bm.last_level_cache_bytes()
    assert size == 32 * 2**20 and "level-3" in where
    # 32 usable CPUs reach four such caches (eight CPUs share each).
    monkeypatch.setattr(bm, "_usable_cpus", lambda: 32)
    assert bm.last_level_cache_bytes()[0] == 4 * 32 * 2**20


def test_last_level_cache_is_unknown_without_sysfs(tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "_CPU0_CACHE_DIR", tmp_path / "missing")
    assert bm.last_level_cache_bytes() is None


@pytest.mark.parametrize(
    "cache, expected",
    [((8 * 2**20, "x"), 64 * 2**20),  # a small cache: at least 64 MiB all the same
     ((96 * 2**20, "x"), 192 * 2**20),  # twice the cache: the two buffers are 4x its size
     (None, 256 * 2**20)],  # unknown cache: the documented default
)
def test_cpu_copy_buffer_outgrows_the_last_level_cache(monkeypatch, cache, expected) -> None:
    monkeypatch.setattr(bm, "last_level_cache_bytes", lambda: cache)
    nbytes, why = bm.copy_buffer_bytes("cpu")
    assert nbytes == expected and f"{expected // 2**20} MiB" in why


def test_cpu_copy_bandwidth_uses_the_cache_sized_buffer(monkeypatch) -> None:
    asked = []

    def small_buffer(device):
        asked.append(device)
        return 2**20, "1 MiB for the test"

    monkeypatch.setattr(bm, "copy_buffer_bytes", small_buffer)
    assert bm.measure_copy_bandwidth("cpu", warmup=0, repeats=2) > 0
    assert asked == [torch.device("cpu")]


@pytest.mark.parametrize(
    "seconds_per_copy, copies",
    [(150e-6, 334),  # 256 MiB on an H100/H200: 334 copies make one 50 ms timing
     (2e-3, 25), (0.2, 1), (0.0, 10_000), (float("nan"), 10_000)],
)
def test_copies_per_timing_make_the_fixed_overhead_negligible(seconds_per_copy, copies) -> None:
    assert bm._copies_per_timing(seconds_per_copy) == copies
    if 0 < seconds_per_copy < 0.05:
        # 20 us of launch and wake-up per timing stays far below 2% of the timed work.
        assert 20e-6 / (copies * seconds_per_copy) < 0.02


def test_host_to_device_needs_a_gpu() -> None:
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        bm.measure_host_to_device("cpu", [1024])


def test_compile_or_reason_returns_a_working_function() -> None:
    # The eager backend exercises torch.compile's wrapping without a C++ compiler.
    compiled, reason = bm.compile_or_reason(bm.multiply_add_unfused, "cpu", backend="eager")
    assert compiled is not None and "works" in reason
    a, b = torch.randn(8), torch.randn(8)
    torch.testing.assert_close(compiled(torch.zeros(8), a, b), a * b)


def test_compile_or_reason_explains_a_failure() -> None:
    compiled, reason = bm.compile_or_reason(bm.multiply_add_unfused, "cpu", backend="no_such")
    assert compiled is None
    assert reason.startswith("torch.compile is not usable here:") and "no_such" in reason


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_synchronised_timer_sees_gpu_work_the_naive_one_misses() -> None:
    device = torch.device("cuda", 0)
    # _sleep spins the GPU for a number of clock cycles: 50M cycles are well over
    # 10 ms at any GPU clock, while queueing the kernel takes microseconds.
    synced = tm.time_fn(lambda: torch.cuda._sleep(50_000_000), device, warmup=1, repeats=3)
    naive = bm.time_naive(lambda: torch.cuda._sleep(50_000_000), device, warmup=1, repeats=3)
    assert synced.min > 0.01
    assert synced.median > naive.median


@pytest.mark.gpu
def test_bare_cuda_resolves_to_the_current_gpu() -> None:
    assert tm.timing_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    assert tm.timing_device(0) == torch.device("cuda", 0)


@pytest.mark.gpu
def test_gpu_copy_bandwidth_is_positive() -> None:
    rate = bm.measure_copy_bandwidth("cuda:0", 2**24, warmup=1, repeats=3)
    assert math.isfinite(rate) and rate > 0


@pytest.mark.gpu
def test_gpu_multiply_add_matches_the_cpu() -> None:
    a, b = torch.randn(1000), torch.randn(1000)
    on_gpu = bm.run_multiply_add(bm.multiply_add_fused, a.cuda(), b.cuda(), steps=4)
    torch.testing.assert_close(on_gpu.cpu(), 4 * a * b)


@pytest.mark.gpu
def test_host_to_device_rows_cover_every_size() -> None:
    rows = bm.measure_host_to_device("cuda:0", [2**16, 2**20], warmup=1, repeats=2)
    assert [r.nbytes for r in rows] == [2**16, 2**20]
    assert all(r.pageable_gbps > 0 and r.pinned_gbps > 0 for r in rows)
    assert all(r.non_blocking_call_seconds >= 0 for r in rows)


def test_sweep_covers_every_size_and_variant_and_table_divides_by_cpu() -> None:
    rows = bm.multiply_add_sweep(
        ["cpu"], [64, 256], steps=2, copy_gbps={"cpu": 5.0}, warmup=0, repeats=1
    )
    assert {(r.numel, r.variant) for r in rows} == {
        (n, v) for n in (64, 256) for v in bm.MULTIPLY_ADD_VARIANTS
    }
    table = bm.multiply_add_table(rows)
    assert len(table) == len(rows)
    assert [line[0] for line in table] == sorted(line[0] for line in table)
    for line in table:
        assert len(line) == len(bm.MULTIPLY_ADD_HEADERS)
        assert line[4] == pytest.approx(1.0)  # the CPU compared with itself
    by_key = {(r.numel, r.variant): r for r in rows}
    first = by_key[(table[0][0], table[0][1])]
    assert table[0][3] == pytest.approx(first.seconds * 1e3)
    assert table[0][6] == pytest.approx(100 * first.gbps / 5.0)


def test_table_speed_up_is_cpu_time_over_device_time() -> None:
    common = dict(numel=8, variant="fused", steps=1, gbps=1.0, share_of_copy_peak=0.5)
    rows = [
        bm.ElementwiseRow(device="cpu", seconds=0.4, **common),
        bm.ElementwiseRow(device="cuda:0", seconds=0.1, **common),
    ]
    speedups = {line[2]: line[4] for line in bm.multiply_add_table(rows)}
    assert speedups == {"cpu": pytest.approx(1.0), "cuda:0": pytest.approx(4.0)}
    assert bm.multiply_add_table(rows[1:])[0][4] == "-"  # nothing to compare with


# --- compiled rows on several devices ----------------------------------------------------------


def _fake_compiled(step):
    def compiled(result, a, b):
        return step(result, a, b)

    compiled._torchdynamo_orig_callable = step  # what torch.compile's wrapper carries
    return compiled


def test_sweep_resets_dynamo_before_each_device_with_a_compiled_variant(monkeypatch) -> None:
    resets = []
    monkeypatch.setattr(bm, "_reset_dynamo", lambda: resets.append(1))
    variants = {"fused": bm.MULTIPLY_ADD_VARIANTS["fused"],
                "compiled": (_fake_compiled(bm.multiply_add_unfused), bm.FUSED_TENSOR_PASSES)}
    rows = bm.multiply_add_sweep(["cpu", "cpu", "cpu"], [256], steps=1,
                                 copy_gbps={"cpu": 10.0}, variants=variants, warmup=0, repeats=1)
    assert len(resets) == 3 and len(rows) == 6
    resets.clear()
    bm.multiply_add_sweep(["cpu", "cpu"], [256], steps=1, copy_gbps={"cpu": 10.0},
                          warmup=0, repeats=1)
    assert resets == []  # nothing compiled, nothing to reset


class _FailOnRecompileLimitHit(Exception):
    """Stands in for torch._dynamo.exc.FailOnRecompileLimitHit (importing dynamo is slow)."""


def test_a_compiled_row_that_falls_back_says_so() -> None:
    def falls_back(result, a, b):
        raise _FailOnRecompileLimitHit("recompile_limit reached")

    with pytest.raises(RuntimeError, match="did not run compiled on cpu.*FailOnRecompileLimitHit"):
        bm.multiply_add_benchmark("cpu", 256, steps=1, step=_fake_compiled(falls_back),
                                  tensor_passes=4, copy_gbps=10.0, variant="compiled", repeats=1)


def test_compile_or_reason_refuses_a_silent_fallback() -> None:
    # The mechanism the sweep relies on, for real: with fullgraph=True, passing the recompile
    # limit raises instead of running eagerly (here forced with a limit of 1 and a new dtype).
    compiled, _ = bm.compile_or_reason(bm.multiply_add_unfused, "cpu", backend="eager")
    assert bm.is_compiled(compiled) and not bm.is_compiled(bm.multiply_add_unfused)
    with torch._dynamo.config.patch(recompile_limit=1):
        x = torch.ones(4, dtype=torch.float64)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            compiled(x, x, x)
    torch._dynamo.reset()


def test_compare_timers_checks_the_device_once_not_on_every_repeat(monkeypatch):
    import d2lgpu.benchmarking as bm

    checked = []
    real = bm.timing_device
    monkeypatch.setattr(bm, "timing_device", lambda device: checked.append(device) or real(device))
    timers = bm.compare_timers(lambda: None, "cpu", warmup=1, repeats=4)
    assert checked == ["cpu"]
    assert len(timers.naive.times) == len(timers.synchronised.times) == 4
