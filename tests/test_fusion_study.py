"""Chapter 2's fusion study, the trace reading and torch.compile on several devices."""

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


def test_study_table_shows_the_best_round_and_its_rate() -> None:
    # the table's time is the fastest round's, per step, and its GB/s come from that time
    numel = 2**20
    seconds = {"copy": (4.0, 2.0, 9.0), "in-place add": (2.0, 3.3, 3.3), "fused": (3.0,) * 3,
               "in-place unfused": (5.0,) * 3, "unfused": (6.0,) * 3}
    times = bm.InterleavedTimes(seconds, {k: None for k in seconds})
    study = bm.FusionStudy("cpu", numel, 2, bm.fusion_study_traffic(numel), times)
    assert study.seconds_per_step("copy") == 1.0  # best round 2.0 s over 2 steps
    assert study.gbps("copy") == pytest.approx(2 * numel * 4 / 1.0 / 1e9)
    rows = {row[0]: row for row in study.table()}
    assert rows["copy"][3] == "1000.00" and rows["copy"][4] == f"{study.gbps('copy'):.1f}"
    assert rows["copy"][6] == "-"  # no page faults counted, none shown


def test_fusion_study_runs_on_the_cpu() -> None:
    study = bm.fusion_study("cpu", 4096, steps=1, rounds=2)
    assert list(study.times.seconds) == ["copy", "in-place add", "fused", "in-place unfused",
                                         "unfused"]
    assert study.peak_gbps > 0 and all(len(t) == 2 for t in study.times.seconds.values())


# ----------------------------------------------------------------------------- Timer and traces


def _event(name, start, end, device="CPU"):
    return SimpleNamespace(name=name, device_type=f"DeviceType.{device}",
                           time_range=SimpleNamespace(start=start, end=end))


def test_trace_spans_on_a_cpu_trace() -> None:
    events = [_event("aten::zeros_like", 0, 5), _event("aten::mul", 10, 20),
              _event("aten::add", 20, 1030)]
    spans = bm.trace_spans(events)
    assert spans == bm.TraceSpans(host_ops=2, host_end=1020, kernels=0, device_end=None)


def test_trace_spans_on_a_gpu_trace() -> None:
    events = [_event("cudaLaunchKernel", 0, 10), _event("cudaLaunchKernel", 990, 1000),
              _event("vectorized_kernel", 100, 2000, device="CUDA")]
    assert bm.trace_spans(events) == bm.TraceSpans(host_ops=2, host_end=1000, kernels=1,
                                                   device_end=2000)


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
