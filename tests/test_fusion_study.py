"""Chapter 2's fusion study, its verdicts, the Timer comparison, the trace reading and
torch.compile on several devices."""

from types import SimpleNamespace

import pytest
import torch

from d2lgpu import benchmarking as bm

# ----------------------------------------------------------------------------- counting bytes


def _sizes(traffic: bm.Traffic, numel: int) -> tuple[float, float]:
    return traffic.read / (4 * numel), traffic.written / (4 * numel)


def test_count_traffic_tells_reads_from_writes() -> None:
    a, b, dst = torch.ones(100), torch.ones(100), torch.empty(100)
    assert _sizes(bm.count_traffic(lambda: dst.copy_(a)), 100) == (1, 1)  # copy_ reads only src
    assert _sizes(bm.count_traffic(lambda: dst.add_(a)), 100) == (2, 1)  # in place: read + write
    assert _sizes(bm.count_traffic(lambda: torch.mul(a, b, out=dst)), 100) == (2, 1)
    fused = bm.count_traffic(lambda: dst.addcmul_(a, b))
    assert _sizes(fused, 100) == (3, 1) and fused.fresh == 0 and fused.ops == 1
    unfused = bm.count_traffic(lambda: dst + a * b)
    assert _sizes(unfused, 100) == (4, 2) and unfused.fresh == 2 and unfused.ops == 2
    assert unfused.moved == unfused.read + unfused.written


def test_count_traffic_charges_nothing_for_views_and_shapes() -> None:
    a = torch.ones(10)
    assert bm.count_traffic(lambda: a.view(2, 5)) == bm.Traffic(0, 0, 0, 1)
    like = bm.count_traffic(lambda: torch.empty_like(a))  # reads a's shape, not its data
    assert like.read == 0 and like.written == 40 and like.fresh == 1


def test_study_traffic_per_step_leaves_setup_out() -> None:
    counted = bm.fusion_study_traffic(2**12)
    passes = {name: t.moved / (4 * 2**12) for name, t in counted.items()}
    assert passes == {"copy": 2, "in-place add": 3, "fused": 4, "in-place unfused": 6,
                      "unfused": 6}
    assert {name: t.fresh for name, t in counted.items()} == {
        "copy": 0, "in-place add": 0, "fused": 0, "in-place unfused": 0, "unfused": 2}
    # the counts agree with the constants chapter 2 quotes
    assert passes["fused"] == bm.FUSED_TENSOR_PASSES
    assert passes["unfused"] == bm.UNFUSED_TENSOR_PASSES


def test_study_loops_compute_steps_times_a_times_b() -> None:
    a, b = torch.randn(64), torch.randn(64)
    torch.testing.assert_close(bm.fusion_study_loops(a, b, steps=3)["copy"](), a)
    for name in ("unfused", "fused", "in-place unfused"):  # fresh loops: result starts at zero
        torch.testing.assert_close(bm.fusion_study_loops(a, b, steps=3)[name](), 3 * a * b,
                                   msg=name)


# ----------------------------------------------------------------------------- timing in rounds


def test_interleaved_times_rotate_the_order_and_count_every_run() -> None:
    calls = []
    loops = {name: (lambda name=name: calls.append(name)) for name in "xyz"}
    times = bm.interleaved_times(loops, "cpu", rounds=3, warmup=1)
    assert calls[:3] == ["x", "y", "z"]  # warm-up
    assert calls[3:] == ["x", "y", "z", "y", "z", "x", "z", "x", "y"]
    assert all(len(t) == 3 for t in times.seconds.values())
    assert set(times.faults) == set("xyz")


def test_ratios_are_taken_within_rounds() -> None:
    # a burst of load doubles both runs of round 2: the within-round ratio stays 2
    times = bm.InterleavedTimes({"slow": (2.0, 4.0, 2.0), "fast": (1.0, 2.0, 1.0)},
                                {"slow": None, "fast": None})
    assert times.ratio("slow", "fast") == 2.0
    assert times.median("slow") == 2.0


def _study(seconds: dict[str, float], faults: float | None = None) -> bm.FusionStudy:
    numel = 2**20
    traffic = bm.fusion_study_traffic(numel)
    times = bm.InterleavedTimes({k: (v, v) for k, v in seconds.items()},
                                {k: faults if k == "unfused" else 0.0 for k in seconds})
    return bm.FusionStudy("cpu", numel, 1, traffic, times)


CPU_LIKE = {"copy": 2.0, "in-place add": 2.0, "fused": 2.9, "in-place unfused": 5.0,
            "unfused": 30.0}
GPU_LIKE = {"copy": 2.0, "in-place add": 3.0, "fused": 4.0, "in-place unfused": 6.0,
            "unfused": 6.2}


def test_study_table_never_shows_more_than_the_peak() -> None:
    for seconds in (CPU_LIKE, GPU_LIKE, {**GPU_LIKE, "fused": 1.0}):
        study = _study(seconds)
        shares = [float(row[5].rstrip(" %")) for row in study.table()]
        assert max(shares) == 100 and all(0 < s <= 100 for s in shares)
        assert len(study.table()[0]) == len(bm.FUSION_STUDY_HEADERS)


def test_study_verdicts_follow_the_numbers() -> None:
    cpu = _study(CPU_LIKE, faults=32768.0).verdicts()
    assert "streams 1.50x the counted bytes" in cpu[0] and "write-allocate" in cpu[0]
    assert cpu[1].startswith("Fusing pays: fused is 1.72x") and "hidden read" in cpu[1]
    assert cpu[2].startswith("Allocating costs: unfused takes 6.00x") and "32,768" in cpu[2]
    gpu = _study(GPU_LIKE).verdicts()
    assert "streams 1.00x" in gpu[0] and "write-allocate" not in gpu[0]
    assert gpu[1].startswith("Fusing pays: fused is 1.50x") and "hidden read" not in gpu[1]
    assert gpu[2].startswith("Allocating costs little here: unfused takes 1.03x")


@pytest.mark.parametrize(("ratio", "costs"), [(1.3, True), (1.2, False)])
def test_write_allocate_verdict_on_both_sides_of_its_threshold(ratio, costs) -> None:
    assert bm.WRITE_ALLOCATE_THRESHOLD == 1.25
    verdict = bm.write_allocate_verdict(ratio)
    assert ("write-allocate" in verdict) == costs
    assert ("moves what it counts" in verdict) == (not costs)


@pytest.mark.parametrize(("ratio", "pays"), [(1.25, True), (1.15, False)])
def test_fusion_verdict_on_both_sides_of_its_threshold(ratio, pays) -> None:
    verdict = bm.fusion_verdict(ratio, 1.5)  # threshold 0.8 * 1.5 = 1.2
    assert verdict.startswith("Fusing pays") == pays
    assert ("something other than memory traffic" in verdict) == (not pays)


@pytest.mark.parametrize(("ratio", "costs"), [(1.3, True), (1.2, False)])
def test_allocation_verdict_on_both_sides_of_its_threshold(ratio, costs) -> None:
    verdict = bm.allocation_verdict(ratio)
    assert verdict.startswith("Allocating costs:") == costs
    assert verdict.startswith("Allocating costs little") == (not costs)
    assert "page faults" not in verdict  # none counted, none claimed


def test_fusion_study_runs_on_the_cpu_and_restores_the_threads() -> None:
    before = torch.get_num_threads()
    study = bm.fusion_study("cpu", 4096, steps=1, rounds=2, threads=1)
    assert torch.get_num_threads() == before
    assert list(study.times.seconds) == ["copy", "in-place add", "fused", "in-place unfused",
                                         "unfused"]
    assert len(study.verdicts()) == 3 and study.peak_gbps > 0


# ----------------------------------------------------------------------------- Timer and traces


@pytest.mark.parametrize(("ratio", "agree"), [(1.19, True), (0.81, True), (1.21, False),
                                              (0.79, False)])
def test_timer_agreement_verdict_on_both_sides_of_its_tolerance(ratio, agree) -> None:
    verdict = bm.timer_agreement_verdict(ratio, 0.2, calls_per_block=100)
    assert ("agree" in verdict) == agree
    assert ("blocks of 100 calls" in verdict) == (not agree)


def test_compare_with_benchmark_timer_times_both_with_the_same_threads() -> None:
    seen = []
    before = torch.get_num_threads()

    def work():
        seen.append(torch.get_num_threads())
        return torch.ones(256).sum()

    agreement = bm.compare_with_benchmark_timer(work, "cpu", rounds=2, min_run_time=0.01,
                                                repeats=2, threads=1)
    assert set(seen) == {1} and torch.get_num_threads() == before
    assert len(agreement.time_fn.times) == 4 and agreement.calls_per_block >= 1
    assert agreement.ratio == agreement.benchmark_timer.median / agreement.time_fn.median


def _event(name, start, end, device="CPU"):
    return SimpleNamespace(name=name, device_type=f"DeviceType.{device}",
                           time_range=SimpleNamespace(start=start, end=end))


def test_trace_spans_and_verdict_on_a_cpu_trace() -> None:
    events = [_event("aten::zeros_like", 0, 5), _event("aten::mul", 10, 20),
              _event("aten::add", 20, 1030)]
    spans = bm.trace_spans(events)
    assert spans == bm.TraceSpans(host_ops=2, host_end=1020, kernels=0, device_end=None)
    assert "only host events: 2 operators" in bm.asynchrony_verdict(spans)


@pytest.mark.parametrize(("kernel_end", "ahead"), [(2000, True), (1150, False)])
def test_asynchrony_verdict_on_both_sides_of_its_threshold(kernel_end, ahead) -> None:
    # host done at 1000 us; the threshold is 20 % of the device's end
    events = [_event("cudaLaunchKernel", 0, 10), _event("cudaLaunchKernel", 990, 1000),
              _event("vectorized_kernel", 100, kernel_end, device="CUDA")]
    verdict = bm.asynchrony_verdict(bm.trace_spans(events))
    assert ("the CPU ran ahead" in verdict) == ahead
    assert ("launch-bound" in verdict) == (not ahead)


def test_trace_spans_need_the_loop_in_the_trace() -> None:
    with pytest.raises(ValueError, match="no host event"):
        bm.trace_spans([_event("aten::sum", 0, 1)])


# ----------------------------------------------------------------------------- compile per device


class _FailOnRecompileLimitHit(Exception):
    pass


def test_compile_on_devices_resets_dynamo_so_the_ninth_device_compiles(monkeypatch) -> None:
    # A stand-in for dynamo: every compiled call on a new device adds a cache entry to the
    # step's code object, and past the limit (8) fullgraph=True raises.
    entries, limit = [], 8

    def fake_compile(step, backend, fullgraph):
        def compiled(result, a, b):
            entries.append(len(entries))  # nine devices: nine entries
            if len(entries) > limit:
                raise _FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")
            return step(result, a, b)

        compiled._torchdynamo_orig_callable = step
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(bm, "_reset_dynamo", entries.clear)
    nine = ["cpu"] * 9  # the CPU and eight GPUs, as far as the cache is concerned
    reasons = [bm.compile_or_reason(bm.multiply_add_unfused, d)[1] for d in nine]
    assert "not usable" in reasons[-1] and all("works" in r for r in reasons[:-1])  # the bug
    entries.clear()
    compiled, reasons = bm.compile_on_devices(bm.multiply_add_unfused, nine)
    assert compiled is not None and len(reasons) == 9
    assert all("works" in r for r in reasons)


def test_a_reset_frees_dynamos_real_recompile_budget() -> None:
    import torch._dynamo

    x = torch.ones(4, dtype=torch.float64)
    with torch._dynamo.config.patch(recompile_limit=1):  # the setting's name in torch 2.9+
        torch._dynamo.reset()
        other = torch.compile(bm.multiply_add_unfused, backend="eager", fullgraph=True)
        other(x, x, x)  # one cache entry, as a previous device would leave
        compiled, reason = bm.compile_or_reason(bm.multiply_add_unfused, "cpu", backend="eager")
        assert compiled is None and "FailOnRecompileLimitHit" in reason
        other(x, x, x)
        compiled, reasons = bm.compile_on_devices(bm.multiply_add_unfused, ["cpu"],
                                                  backend="eager")
        assert compiled is not None and "works" in reasons[0]
    torch._dynamo.reset()


def test_yardsticks_are_compared_at_their_best_rounds() -> None:
    # medians say the two stream alike (a burst of load on the in-place add's rounds);
    # the best rounds show the copy's hidden third tensor-size
    numel = 2**20
    seconds = {"copy": (2.0, 2.2, 9.0), "in-place add": (2.0, 3.3, 3.3), "fused": (3.0,) * 3,
               "in-place unfused": (5.0,) * 3, "unfused": (6.0,) * 3}
    times = bm.InterleavedTimes(seconds, {k: None for k in seconds})
    study = bm.FusionStudy("cpu", numel, 1, bm.fusion_study_traffic(numel), times)
    assert times.best("in-place add") == 2.0
    assert "streams 1.50x" in study.verdicts()[0]


def test_write_allocate_verdict_says_when_the_gap_is_more_than_bytes() -> None:
    assert "the rest of the gap is not bytes" in bm.write_allocate_verdict(2.06)
    assert "the rest of the gap" not in bm.write_allocate_verdict(1.6)  # within 10 % of 1.5
