"""Tests of d2lgpu.profiling: reading and drawing traces, memory timelines, the roofline,
the ablation, and graph breaks."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import pickle
import statistics

import pytest
import torch
from torch import nn
from torch.utils import data

import d2lgpu
from d2lgpu import profiling as P
from d2lgpu.data import DeviceLoader
from d2lgpu.fast import TECHNIQUES, Techniques

CPU = torch.device("cpu")


def ablation_benchmark():
    """benchmarks/ablation.py as a module: it formats the ablation's table."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "ablation.py"
    spec = importlib.util.spec_from_file_location("ablation_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- #
# Synthetic traces: events whose counts we know
# --------------------------------------------------------------------------- #


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def synthetic_trace(gpu: bool = False) -> dict:
    """Two steps with a DataLoader fetch before each and two .item() calls inside each,
    one .item() outside the steps (a dataset's label lookup), a fetch after the last
    step (the one that ends the epoch), and on a GPU two kernels with a gap between."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation",
           0, 10),
        _x("aten::item", "cpu_op", 2, 1),  # inside a fetch, not a step
        _x("train_step", "user_annotation", 10, 40),
        _x("aten::addmm", "cpu_op", 12, 20),
        _x("aten::item", "cpu_op", 35, 2),
        _x("aten::item", "cpu_op", 40, 2),
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation",
           50, 30),
        _x("train_step", "user_annotation", 80, 40),
        _x("aten::item", "cpu_op", 100, 2),
        _x("aten::item", "cpu_op", 110, 2),
        _x("aten::item", "cpu_op", 110, 2, tid=2),  # another thread: not this loop's
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation",
           120, 5),
        {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1,
         "ts": 13, "args": {"Total Allocated": 4096, "Bytes": 4096, "Device Type": 0,
                            "Device Id": -1}},
        {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1,
         "ts": 30, "args": {"Total Allocated": 1024, "Bytes": -3072, "Device Type": 0,
                            "Device Id": -1}},
        {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "pid": 1, "tid": 1, "ts": 12, "id": 1},
    ]
    if gpu:
        events += [_x("void gemm_kernel", "kernel", 20, 10, tid=7),
                   _x("void relu_kernel", "kernel", 90, 10, tid=7)]
    return {"traceEvents": events, "schemaVersion": 1}


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(synthetic_trace()))
    return path


def test_read_trace_keeps_durations_and_instants_sorted(trace_path, tmp_path):
    events = P.read_trace(trace_path)
    assert len(events) == 14  # 12 "X" + 2 "i"; metadata and flow events dropped
    assert [e.start_us for e in events] == sorted(e.start_us for e in events)
    step = next(e for e in events if e.name == "train_step")
    assert (step.start_us, step.end_us, step.category) == (10, 50, "user_annotation")
    gz = tmp_path / "trace.json.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        json.dump(synthetic_trace(), f)
    assert P.read_trace(gz) == events


def test_read_trace_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="export_chrome_trace"):
        P.read_trace(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"foo": 1}))
    with pytest.raises(ValueError, match="traceEvents"):
        P.read_trace(tmp_path / "other.json")


def test_summary_counts_syncs_inside_steps_and_fetches_that_fed_them(trace_path):
    summary = P.summarize_trace(P.read_trace(trace_path))
    assert summary.train_steps == 2
    assert summary.item_calls == 4 and summary.item_calls_per_step == 2
    assert summary.dataloader_fetches == 2  # the fetch after the last step fed nothing
    assert summary.step_ms == pytest.approx(0.080)
    assert summary.dataloader_ms == pytest.approx(0.040)
    assert summary.sync_ms == pytest.approx(0.008)
    assert summary.dataloader_share == pytest.approx(40 / 120)


def test_summary_needs_train_steps():
    events = [P.TraceEvent("aten::mm", "cpu_op", 0, 5, 1)]
    with pytest.raises(ValueError, match="record_function"):
        P.summarize_trace(events)


def test_merge_intervals_and_idle_gaps():
    assert P.merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    busy = [(2, 4), (3, 5), (8, 9)]
    assert P.idle_gaps(busy, 0, 10) == [(0, 2), (5, 8), (9, 10)]
    assert P.idle_gaps(busy, 0, 10, min_gap=1.5) == [(0, 2), (5, 8)]
    assert P.idle_gaps([], 0, 3) == [(0, 3)]
    assert P.idle_gaps([(0, 10)], 2, 5) == []


def test_timeline_lanes_on_a_cpu_and_a_gpu_trace(tmp_path, trace_path):
    lanes = P.timeline_lanes(P.read_trace(trace_path))
    assert lanes["train steps"] == [(10, 50), (80, 120)]
    assert lanes[".item() in steps"] == [(35, 37), (40, 42), (100, 102), (110, 112)]
    assert "GPU kernels" not in lanes and "host ops" not in lanes
    assert lanes["idle"] == [(50, 80)]  # on a CPU the model idles between steps

    gpu_path = tmp_path / "gpu.json"
    gpu_path.write_text(json.dumps(synthetic_trace(gpu=True)))
    gpu_lanes = P.timeline_lanes(P.read_trace(gpu_path))
    assert gpu_lanes["GPU kernels"] == [(20, 30), (90, 100)]
    assert gpu_lanes["idle"] == [(10, 20), (30, 90), (100, 120)]  # gaps between kernels
    assert (12, 32) in gpu_lanes["host ops"]


def test_plot_timeline_draws_one_labelled_lane_each(trace_path):
    import matplotlib

    matplotlib.use("Agg")
    ax = P.plot_timeline(P.read_trace(trace_path), title="two steps")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["train steps", "DataLoader", ".item() in steps"]
    # from the fetch before the first step to the end of the last, in ms from the first step
    assert ax.get_xlim() == pytest.approx((-0.010, 0.110))
    assert ax.get_legend() is not None  # the idle gap is marked


# --------------------------------------------------------------------------- #
# Profiling real training: the no_sync switch, seen in the trace
# --------------------------------------------------------------------------- #


def tiny_loaders(n: int = 64, batch: int = 16):
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=generator)
    labels = torch.arange(n) % 4
    dataloaders = (data.DataLoader(data.TensorDataset(images.float() / 255, labels), batch),
                   data.DataLoader(data.TensorDataset(images.float() / 255, labels), batch))
    resident = (DeviceLoader(images, labels, batch, device=CPU, shuffle=True),
                DeviceLoader(images, labels, batch, device=CPU))
    return dataloaders, resident


def tiny_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 4))


def profiled_training(techniques: Techniques, loaders, tmp_path):
    with torch.profiler.profile(activities=P.profiler_activities(CPU)) as prof:
        d2lgpu.train_fast(tiny_net(), *loaders, 1, 0.1, CPU, seed=0, techniques=techniques,
                          progress=False)
    path = tmp_path / "run.json"
    prof.export_chrome_trace(str(path))
    return prof, P.read_trace(path)


def test_profiled_d2l_loop_syncs_twice_per_step_and_fetches_every_batch(tmp_path):
    dataloaders, resident = tiny_loaders()
    prof, events = profiled_training(Techniques.d2l_style(), dataloaders, tmp_path)
    summary = P.summarize_trace(events)
    assert summary.train_steps == 4
    assert summary.item_calls == 8  # loss.item() and the correct count, every step
    assert summary.dataloader_fetches == 4
    table = P.op_table(prof, top=5)
    assert all(len(line) <= 100 for line in table.splitlines())
    assert "self CPU ms" in table.splitlines()[0]

    _, fast_events = profiled_training(Techniques(device_data=True), resident, tmp_path)
    fast = P.summarize_trace(fast_events)
    assert fast.train_steps == 4
    assert fast.item_calls == 0 and fast.dataloader_fetches == 0


def test_profiler_activities(monkeypatch):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    assert P.profiler_activities("cpu") == [torch.profiler.ProfilerActivity.CPU]
    assert os.environ["KINETO_LOG_LEVEL"] == "6"
    monkeypatch.setenv("KINETO_LOG_LEVEL", "2")  # a level the user chose stays
    P.profiler_activities("cpu")
    assert os.environ["KINETO_LOG_LEVEL"] == "2"
    assert torch.profiler.ProfilerActivity.CUDA in P.profiler_activities("cuda:0")


def test_op_table_refuses_an_empty_profile():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pass
    with pytest.raises(ValueError, match="no operators"):
        P.op_table(prof)


# --------------------------------------------------------------------------- #
# Memory timelines
# --------------------------------------------------------------------------- #


def test_memory_timeline_from_a_trace(trace_path):
    timeline = P.memory_timeline_from_trace(P.read_trace(trace_path))
    assert timeline == [(13, 4096), (30, 1024)]
    with pytest.raises(ValueError, match="profile_memory"):
        P.memory_timeline_from_trace(P.read_trace(trace_path), "cuda:0")


def test_memory_timeline_of_a_real_cpu_profile_rises_and_falls(tmp_path):
    net = tiny_net()
    X = torch.randn(32, 1, 8, 8)
    with torch.profiler.profile(activities=P.profiler_activities(CPU),
                                profile_memory=True) as prof:
        activations = net(X)  # kept alive until backward: memory rises
        activations.sum().backward()
        del activations
    path = tmp_path / "memory.json"
    prof.export_chrome_trace(str(path))
    timeline = P.memory_timeline_from_trace(P.read_trace(path))
    levels = [b for _, b in timeline]
    assert len(levels) > 4 and max(levels) > levels[-1] >= 0


def test_memory_timeline_from_a_snapshot_counts_what_was_there_before(tmp_path):
    snapshot = {
        "segments": [{"device": 0, "blocks": [
            {"size": 1000, "state": "active_allocated"},  # weights, allocated before recording
            {"size": 300, "state": "active_allocated"},
            {"size": 700, "state": "inactive"},
        ]}],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 0, "size": 2000, "time_us": 1},
            {"action": "alloc", "addr": 1, "size": 500, "time_us": 5},
            {"action": "alloc", "addr": 2, "size": 300, "time_us": 6},
            {"action": "free_requested", "addr": 1, "size": 500, "time_us": 7},
            {"action": "free_completed", "addr": 1, "size": 500, "time_us": 8},
        ]],
    }
    # 1300 allocated at the end, +300 net over the history: 1000 before it began.
    expected = [(5.0, 1500), (6.0, 1800), (8.0, 1300)]
    assert P.memory_timeline_from_snapshot(snapshot) == expected
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    assert P.memory_timeline_from_snapshot(path) == expected
    with pytest.raises(ValueError, match="_record_memory_history"):
        P.memory_timeline_from_snapshot({"segments": [], "device_traces": [[]]})
    with pytest.raises(ValueError, match="device index 1"):
        P.memory_timeline_from_snapshot(snapshot, device_index=1)


def test_a_file_that_is_not_a_memory_snapshot_is_named_with_what_a_snapshot_is(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a pickle")
    listed = tmp_path / "list.pickle"
    listed.write_bytes(pickle.dumps([1, 2, 3]))
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    cases = [
        (text, ValueError, r"notes.txt is not a memory snapshot \(UnpicklingError"),
        (empty, ValueError, r"empty.pickle is not a memory snapshot"),
        (listed, ValueError, r"list.pickle holds a pickled list, not a memory snapshot"),
        (tmp_path, ValueError, r"is not a memory snapshot \(IsADirectoryError"),
        (tmp_path / "missing.pickle", FileNotFoundError, r"no memory snapshot at .*missing"),
    ]
    for path, error, words in cases:
        with pytest.raises(error, match=words) as info:
            P.memory_timeline_from_snapshot(path)
        assert "torch.cuda.memory._dump_snapshot" in str(info.value)


def test_plot_memory_timeline_in_mib():
    import matplotlib

    matplotlib.use("Agg")
    ax = P.plot_memory_timeline([(0.0, 0), (1000.0, 2**21), (3000.0, 2**20)],
                                spans=[(0.0, 2000.0, "step 1")])
    x, y = ax.lines[0].get_data()
    assert list(x) == [0.0, 1.0, 3.0] and list(y) == [0.0, 2.0, 1.0]


# --------------------------------------------------------------------------- #
# The roofline
# --------------------------------------------------------------------------- #


def test_roofline_ridge_attainable_and_regimes():
    roof = P.Roofline(peak_tflops=10.0, bandwidth_gbps=1000.0)
    assert roof.ridge == pytest.approx(10.0)  # 10e12 FLOP/s over 1e12 B/s
    assert roof.attainable_tflops(1.0) == pytest.approx(1.0)
    assert roof.attainable_tflops(100.0) == pytest.approx(10.0)
    # 8 TFLOP/s at intensity 100: near the compute roof.
    big = P.RooflinePoint("matmul", flops=8e12, nbytes=8e10, seconds=1.0)
    # 0.05 TFLOP/s at intensity 0.1 (roof 0.1): memory-bound.
    stream = P.RooflinePoint("add", flops=5e10, nbytes=5e11, seconds=1.0)
    # 0.001 TFLOP/s at the same intensity: 1% of its roof.
    tiny = P.RooflinePoint("tiny add", flops=1e9, nbytes=1e10, seconds=1.0)
    assert [roof.regime(p) for p in (big, stream, tiny)] == [
        "compute-bound", "memory-bound", "overhead-bound"]
    assert stream.achieved_gbps == pytest.approx(500.0)
    with pytest.raises(ValueError):
        P.Roofline(peak_tflops=0.0, bandwidth_gbps=1.0)


def _pin_auto_format(monkeypatch, dtype):
    """Make precision_policy(..., "auto") pick ``dtype`` whatever this CPU offers."""
    import d2lgpu.precision as precision

    real = precision.precision_policy

    def pinned(device, precision_word="auto", capability=None):
        if precision_word == "auto":
            return precision.PrecisionPolicy(torch.device(device).type,
                                             None if dtype == torch.float32 else dtype, False)
        return real(device, precision_word, capability)

    monkeypatch.setattr(precision, "precision_policy", pinned)


@pytest.mark.parametrize("dtype, element_size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_measured_roofline_follows_the_automatic_format(monkeypatch, dtype, element_size):
    # Both branches of the CPU's bf16 decision, on any CPU.
    _pin_auto_format(monkeypatch, dtype)
    roof, matmul = P.measure_roofline(CPU, 64, repeats=2, bandwidths={"add": 1.0})
    assert matmul.nbytes == 3 * 64 * 64 * element_size
    assert matmul.intensity == pytest.approx(2 * 64**3 / (3 * 64 * 64 * element_size))
    name = str(dtype).replace("torch.", "")
    assert matmul.name.endswith(name) and roof.compute_label == f"best {name} matmul"


def test_measured_roofline_and_points_on_the_cpu():
    import matplotlib

    matplotlib.use("Agg")
    roof, matmul = P.measure_roofline(CPU, 64, repeats=2, bandwidths={"add": 10.0})
    assert roof.peak_tflops > 0 and roof.bandwidth_gbps > 0
    assert matmul.flops == 2 * 64**3 and matmul.intensity == pytest.approx(
        2 * 64**3 / matmul.nbytes)
    assert roof.peak_tflops >= matmul.achieved_tflops  # the roof is the best run
    stream, tiny = P.roofline_points(CPU, elementwise_numel=1000, tiny_numel=8,
                                     tiny_repeats=10, repeats=2)
    assert (stream.flops, stream.nbytes) == (1000, 12000)
    assert (tiny.flops, tiny.nbytes) == (80, 960)
    ax = P.plot_roofline(roof, [matmul, stream, tiny])
    assert len(ax.collections) == 3


# --------------------------------------------------------------------------- #
# The ablation
# --------------------------------------------------------------------------- #


def test_ablation_plan_on_a_cpu_adds_one_technique_per_row(monkeypatch):
    import d2lgpu.precision as precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    plan = P.ablation_plan(CPU, skip={"compile": "not today"})
    assert [step.label for step in plan] == list(P.ABLATION_LABELS.values())
    assert plan[0].techniques == Techniques.d2l_style()
    skipped = {step.technique: step.skip_reason for step in plan if step.skip_reason}
    # Fused SGD runs on a CPU where torch has the kernel (2.15 does), and its row trains there.
    fused_here = "cpu" in d2lgpu.fast.fused_sgd_device_types()
    assert set(skipped) == {"precision", "channels_last", "compile", "cuda_graphs"} | (
        set() if fused_here else {"fused_optimizer"})
    assert skipped["compile"] == "not today"
    assert all(len(reason) <= 64 for reason in skipped.values())
    # Each row that runs adds its technique to the previous row's; skipped ones add none.
    for before, step in zip(plan, plan[1:], strict=False):
        added = {name for name in TECHNIQUES
                 if getattr(step.techniques, name) != getattr(before.techniques, name)}
        assert added == (set() if step.skip_reason else {step.technique})
    assert plan[-1].techniques == Techniques(device_data=True, no_sync=True,
                                             fused_optimizer=fused_here)

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    with_bf16 = P.ablation_plan(CPU)
    assert with_bf16[3].technique == "precision" and with_bf16[3].skip_reason is None
    assert with_bf16[3].label == "+ mixed precision"
    assert with_bf16[-1].techniques.precision == "auto"
    # The last row is the fast path (with torch.compile where this CPU can compile).
    assert dataclasses.replace(with_bf16[-1].techniques, compile=False) == Techniques.fast(CPU)
    with pytest.raises(ValueError, match="unknown techniques"):
        P.ablation_plan(CPU, skip={"warp_speed": "no"})


def train_rows(dataloaders, resident, num_epochs=2):
    """What chapter 7's cell trains for a row: a fresh model from seed 0 on its loaders."""
    def train_row(step):
        loaders = resident if step.techniques.device_data else dataloaders
        return d2lgpu.train_fast(tiny_net(), *loaders, num_epochs, 0.1, CPU, seed=0,
                                 techniques=step.techniques, progress=False)
    return train_row


def test_run_ablation_tables_every_row_and_the_same_seed_trains_alike():
    import matplotlib

    matplotlib.use("Agg")
    dataloaders, resident = tiny_loaders(n=64, batch=16)
    plan = P.ablation_plan(CPU, skip={"compile": "slow in tests"})[:4]
    rows = P.run_ablation(plan, train_rows(dataloaders, resident))
    assert [r.label for r in rows] == [s.label for s in plan]
    ran = [r for r in rows if r.ran]
    assert all(r.images_per_second > 0 for r in ran)
    assert all(n is None or n.mfu is None for n in P.ablation_numbers(rows, 1e6, None))
    assert all(r.history.num_epochs == 2 for r in ran)
    # Rows 2 and 3 differ only in when the loss is read: on the CPU, the same run
    # (its mean is summed in float64 on the host in one, in float32 on the device in the other).
    assert rows[1].history.train_loss == pytest.approx(rows[2].history.train_loss, rel=1e-6)
    assert rows[1].history.test_acc == rows[2].history.test_acc
    table = ablation_benchmark().format_ablation_table(rows)
    assert all(len(line) <= 100 for line in table.splitlines())
    assert [line.split("  ")[0].strip() for line in table.splitlines()[2:2 + len(rows)]] == [
        r.label for r in rows]

    baseline = P.ablation_numbers(rows, flops_per_example=1e6, peak=1.0)[0]
    assert baseline.mfu == pytest.approx(rows[0].images_per_second * 1e6 / 1e12)


def test_mfu_note_on_a_cpu():
    assert "n/a" in P.mfu_note(CPU, None)
    assert "989" in P.mfu_note(CPU, 989.0)


def test_counting_keeps_kinetos_start_and_stop_lines_quiet(monkeypatch):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    events = P._profiled_events(lambda: torch.ones(2).sum())
    assert os.environ["KINETO_LOG_LEVEL"] == "6" and any(e.name == "aten::sum" for e in events)


def test_ablation_data_holds_the_same_examples_both_ways():
    (train_iter, test_iter), (train_res, test_res) = P.ablation_data(
        32, CPU, train_size=100, test_size=50, quick=False)
    assert len(train_iter.dataset) == train_res.num_examples == 100
    assert len(test_iter.dataset) == test_res.num_examples == 50
    labels = torch.cat([y for _, y in data.DataLoader(train_iter.dataset, 100)])
    assert torch.equal(labels, train_res.labels)


# --------------------------------------------------------------------------- #
# torch.compile and CUDA graphs
# --------------------------------------------------------------------------- #


def test_graph_breaks_are_found_and_explained():
    def with_breaks(x):
        y = torch.sin(x)
        print("a print is a side effect dynamo cannot put in a graph")
        return torch.cos(y) + y.sum().item()

    def without_breaks(x):
        return torch.cos(torch.sin(x)) + x.sum()

    report = P.explain_graph_breaks(with_breaks, torch.randn(4))
    assert report.break_count == 2 and report.graph_count == 3
    first, second = report.breaks
    assert first.code.startswith("print(") and "print" in first.explanation
    assert second.code == "return torch.cos(y) + y.sum().item()"
    assert "item()" in second.reason
    text = report.describe()
    assert text.splitlines()[0] == "3 graph(s), 2 graph break(s)"
    assert all(len(line) <= 100 for line in text.splitlines())
    clean = P.explain_graph_breaks(without_breaks, torch.randn(4))
    assert (clean.graph_count, clean.break_count, clean.breaks) == (1, 0, ())


def test_runs_dir_is_git_ignored_here():
    path = P.runs_dir("test-profiling")
    assert path.is_dir() and path.parent.name == "runs"
    for bad in ("", "a/b", "..", 7):
        with pytest.raises(ValueError):
            P.runs_dir(bad)


@pytest.mark.gpu
def test_gpu_trace_shows_kernels_and_the_d2l_loop_syncs(tmp_path):
    device = torch.device("cuda", 0)
    images = torch.randint(0, 256, (64, 1, 8, 8), dtype=torch.uint8)
    labels = torch.arange(64) % 4
    resident = (DeviceLoader(images, labels, 16, device=device, shuffle=True),
                DeviceLoader(images, labels, 16, device=device))
    for techniques, syncs in ((Techniques(device_data=True, no_sync=False), 8),
                              (Techniques.fast(device), 0)):
        with torch.profiler.profile(activities=P.profiler_activities(device)) as prof:
            d2lgpu.train_fast(tiny_net(), *resident, 1, 0.1, device, seed=0,
                              techniques=techniques, progress=False)
        path = tmp_path / "gpu.json"
        prof.export_chrome_trace(str(path))
        events = P.read_trace(path)
        assert P.summarize_trace(events).item_calls == syncs
        assert "GPU kernels" in P.timeline_lanes(events)


@pytest.mark.gpu
def test_gpu_compile_modes_compute_the_same_step():
    device = torch.device("cuda", 0)
    X = torch.randn(16, 1, 8, 8)
    y = torch.randint(0, 4, (16,))
    rows = P.compare_compile_modes(tiny_net, (X, y), device,
                                   modes=("eager", "default", "reduce-overhead"), repeats=3)
    assert [r.mode for r in rows] == ["eager", "default", "reduce-overhead"]
    assert all(r.first_call_seconds > 0 and r.step_seconds > 0 for r in rows)
    # Same seed, same number of steps: the compiled modes compute the eager step.
    for row in rows[1:]:
        assert row.loss == pytest.approx(rows[0].loss, rel=1e-3)


# --------------------------------------------------------------------------- #
# Bad input, GPU timing with fake events, the ablation's statistics
# --------------------------------------------------------------------------- #


def test_roofline_values_are_checked():
    for bad in (dict(flops=-1.0), dict(nbytes=0.0), dict(seconds=float("nan"))):
        kwargs = dict(flops=1.0, nbytes=1.0, seconds=1.0) | bad
        with pytest.raises(ValueError, match="nbytes > 0"):
            P.RooflinePoint("op", **kwargs)
    assert P.RooflinePoint("op", flops=0, nbytes=4, seconds=1.0).intensity == 0
    for bad in (float("inf"), -1.0, float("nan")):
        with pytest.raises(ValueError, match="peak_tflops"):
            P.Roofline(peak_tflops=bad, bandwidth_gbps=1.0)


def test_read_trace_refuses_what_it_cannot_read(tmp_path):
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00\xffnot json at all")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        P.read_trace(garbage)
    fake_gz = tmp_path / "trace.json.gz"
    fake_gz.write_text("plain text, not gzip")
    with pytest.raises(ValueError, match="not a Chrome trace"):
        P.read_trace(fake_gz)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="traceEvents"):
        P.read_trace(tmp_path / "list.json")
    (tmp_path / "bad_ts.json").write_text(json.dumps(
        {"traceEvents": [{"ph": "X", "name": "op", "ts": "soon", "dur": 1}]}))
    with pytest.raises(ValueError, match="not a Chrome trace.*soon"):
        P.read_trace(tmp_path / "bad_ts.json")
    with pytest.raises(ValueError, match="directory"):
        P.read_trace(tmp_path)


class _FakeCuda:
    """Stands in for the parts of torch.cuda that the GPU timers use, and records which
    device each call named. Its events' clock advances 2 ms per
    record, 3 ms for the first timing, so the best timing is known."""

    def __init__(self, monkeypatch):
        self.clock, self.created, self.log = 0.0, 0, []
        self.current = 0  # the process's current GPU
        cuda = self

        class Stream:
            def __init__(self, device=None):
                self.device = torch.device(device) if device is not None else \
                    torch.device("cuda", cuda.current)
                cuda.log.append(("Stream", self.device))

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                cuda.created += 1
                self.t = None

            def record(self, stream=None):
                cuda.log.append(("record", stream.device if stream else cuda.current))
                cuda.clock += 3.0 if cuda.created <= 2 else 2.0
                self.t = cuda.clock

            def synchronize(self):
                assert self.t is not None

            def elapsed_time(self, end):
                return end.t - self.t

        @contextlib.contextmanager
        def device(d):
            before, cuda.current = cuda.current, torch.device(d).index
            cuda.log.append(("device", cuda.current))
            try:
                yield
            finally:
                cuda.current = before

        def current_stream(device=None):
            d = torch.device("cuda", cuda.current) if device is None else torch.device(device)
            cuda.log.append(("current_stream", d))
            return Stream(d)

        self.Stream = Stream
        for name, value in (("Event", Event), ("Stream", Stream), ("device", device),
                            ("current_stream", current_stream)):
            monkeypatch.setattr(torch.cuda, name, value)


def test_gpu_timings_come_from_cuda_events_on_the_given_device(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    monkeypatch.setattr(P, "timed_calls", lambda *a, **k: pytest.fail("host clock used on a GPU"))
    calls = []
    seconds = P._best_seconds(lambda: calls.append(cuda.current), torch.device("cuda", 1),
                              warmup=2, repeats=3)
    assert len(calls) == 5 and cuda.created == 6
    assert seconds == pytest.approx(2e-3)  # the best pair, in seconds
    # The work ran with GPU 1 current, and the events were recorded on GPU 1's stream,
    # although GPU 0 is the process's current device.
    assert calls == [1] * 5 and cuda.current == 0
    assert ("current_stream", torch.device("cuda", 1)) in cuda.log
    assert {d for what, d in cuda.log if what == "record"} == {torch.device("cuda", 1)}


def test_stream_bandwidth_counts_three_passes_and_the_highest_roof_is_the_memory_roof():
    add = P.measure_stream_bandwidth(CPU, 1 << 16, repeats=2)
    assert add > 0
    roof, _ = P.measure_roofline(CPU, 32, repeats=2, bandwidths={"copy": add / 2, "add": add})
    assert set(roof.bandwidths) == {"copy", "add"}
    assert roof.bandwidth_gbps == add and roof.memory_label == "add"


def _row(label_index, speeds, ran=True, runs=2):
    """A row whose ``speeds`` (epochs after the first) came from ``runs`` interleaved runs."""
    plan = P.ablation_plan(CPU, skip={"compile": "not here"})
    step = plan[label_index]
    if not ran:
        return P.AblationRow(step)
    history = d2lgpu.History(examples_per_second=[1.0, *speeds], test_acc=[0.8] * 5,
                             epoch_seconds=[1.0] * 5)
    per_run = len(speeds) // runs
    rounds = tuple(tuple(speeds[i * per_run:(i + 1) * per_run]) for i in range(runs))
    return P.AblationRow(step, history, rounds)


def test_ablation_numbers_chain_the_paired_ratios_so_table_and_bars_agree():
    base = _row(0, [100, 104, 50, 52])  # run 2 of everything hit a busy spell
    # Faster epoch by epoch, though its slow run is slower than the baseline's fast one,
    # so its own median could fall below the baseline's under a load that hit it alone:
    faster = _row(1, [150, 160, 75, 77])
    assert P.speed_ratios(faster, base) == pytest.approx((1.5, 160 / 104, 1.5, 77 / 52))
    slower = _row(2, [60, 62, 30, 31])  # against `faster`: 0.4x
    rows = [base, faster, _row(3, [], ran=False), slower]
    assert P.previous_ran(rows, rows[3]) is rows[1] and P.previous_ran(rows, rows[0]) is rows[0]
    numbers = P.ablation_numbers(rows)
    assert numbers[2] is None
    assert numbers[0].x_prev == 1.0 and numbers[0].images_per_second == base.images_per_second
    x_prev = statistics.median(P.speed_ratios(faster, base))
    assert numbers[1].x_prev == pytest.approx(x_prev) and numbers[1].low == pytest.approx(77 / 52)
    # The speed shown is chained: faster than the row before exactly when x prev > 1.
    assert numbers[1].images_per_second == pytest.approx(base.images_per_second * x_prev)
    assert numbers[3].images_per_second < numbers[1].images_per_second
    assert numbers[3].x_base == pytest.approx(numbers[3].images_per_second / base.images_per_second)
    table = ablation_benchmark().format_ablation_table(rows)
    assert all(len(line) <= 100 for line in table.splitlines())
    body = table.splitlines()[2:6]
    assert f" {x_prev:.2f}x " in body[1] and "skipped" in body[2]
    assert f"{numbers[1].images_per_second:,.0f}" in body[1]
    assert "verdict" not in table and "faster" not in table


def test_run_ablation_interleaves_its_repeats(monkeypatch):
    order = []

    def fake_train(step, num_epochs=3):
        order.append(str(step.techniques))
        return d2lgpu.History(examples_per_second=[1.0] + [10.0 * len(order)] * (num_epochs - 1),
                              test_acc=[0.9] * num_epochs, epoch_seconds=[1.0] * num_epochs)

    plan = P.ablation_plan(CPU, skip={"compile": "not here"})[:3]
    ran = []
    rows = P.run_ablation(plan, fake_train, repeats=2, on_run=ran.append)
    labels = [str(step.techniques) for step in plan]
    assert order == labels + labels[::-1]  # round 1 of every row, then round 2 backwards
    assert ran == plan + plan[::-1] and [r.label for r in rows] == [s.label for s in plan]
    # The baseline ran first in round 1 and last (the 6th run) in round 2:
    assert rows[0].images_per_second == 35.0
    assert rows[0].round_speeds == ((10.0, 10.0), (60.0, 60.0))


def test_run_ablation_trains_no_skipped_row_but_reports_it():
    plan = P.ablation_plan(CPU, skip={"no_sync": "not this time", "compile": "not here"})[:4]
    trained, reported = [], []

    def fake_train(step):
        trained.append(step.technique)
        return d2lgpu.History(examples_per_second=[1.0, 2.0], test_acc=[0.9] * 2,
                              epoch_seconds=[1.0] * 2)

    rows = P.run_ablation(plan, fake_train, on_run=reported.append)
    assert [s.technique for s in plan][2] == "no_sync" and plan[2].skip_reason
    assert None in trained and "no_sync" not in trained and reported == plan
    assert not rows[2].ran and rows[2].images_per_second is None and rows[1].ran


@pytest.mark.parametrize("call, name", [
    (lambda: P.ablation_settings(True), "chosen"),
    (lambda: P.runs_dir(7), "name"),
])
def test_ablation_settings_and_runs_dir_name_a_bad_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("function", [P.profiler_activities, P.ablation_plan])
def test_profiling_helpers_name_a_bad_device(function):
    with pytest.raises(ValueError, match="device"):
        function(-1)


# --------------------------------------------------------------------------- #
# Compiled comparisons stay compiled: dynamo's recompile limit
# --------------------------------------------------------------------------- #


def _compiled_twice(compile_fn):
    """Two fresh models through ``compile_fn``, on two batch sizes, with dynamo's recompile
    limit at 1 (8 in torch): the cache of ``forward`` is shared by every instance, so the
    second shape is one entry too many unless the caches were emptied."""
    with torch._dynamo.config.patch(recompile_limit=1):
        return [compile_fn(tiny_net())(torch.randn(n, 1, 8, 8)) for n in (2, 3)]


def test_past_the_recompile_limit_fullgraph_raises_instead_of_running_eager():
    torch._dynamo.reset()
    # Without fullgraph, the second model silently runs eagerly; with it, an error.
    _compiled_twice(lambda net: torch.compile(net, backend="eager", dynamic=False))
    torch._dynamo.reset()
    with pytest.raises(getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", Exception)):
        _compiled_twice(lambda net: torch.compile(net, backend="eager", dynamic=False,
                                                  fullgraph=True))
    # fresh_compile empties the caches first: every model gets compiled.
    outs = _compiled_twice(lambda net: P.fresh_compile(net, backend="eager", dynamic=False))
    assert [o.shape[0] for o in outs] == [2, 3]
    torch._dynamo.reset()


def test_compile_modes_compile_the_whole_step_after_a_reset(monkeypatch):
    resets = []
    real_reset = torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: (resets.append(1), real_reset()))
    X, y = torch.randn(8, 1, 8, 8), torch.arange(8) % 4
    rows = P.compare_compile_modes(tiny_net, (X, y), CPU, modes=("eager", "default"),
                                   repeats=2, backend="eager")
    assert [r.mode for r in rows] == ["eager", "default"] and len(resets) == 1
    # Same seed and steps: the compiled step (optimizer update included) computes the eager one.
    assert rows[1].loss == pytest.approx(rows[0].loss, rel=1e-5)


def test_run_ablation_resets_dynamo_before_every_compiled_run(monkeypatch):
    events = []

    def fake_train(step):
        events.append("compiled" if step.techniques.compile else "eager")
        return d2lgpu.History(examples_per_second=[1.0, 2.0], test_acc=[0.9] * 2,
                              epoch_seconds=[1.0] * 2)

    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append("reset"))
    plan = [s for s in P.ablation_plan(CPU) if s.technique in (None, "compile")]
    if plan[-1].skip_reason:
        pytest.skip(f"no torch.compile here: {plan[-1].skip_reason}")
    P.run_ablation(plan, fake_train, repeats=2)
    # round 2 runs the rows backwards: the compiled row first
    assert events == ["eager", "reset", "compiled", "reset", "compiled", "eager"]


def test_compile_model_compiles_with_fullgraph(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda net, **kw: seen.update(kw) or net)
    from d2lgpu.fast import compile_model

    if d2lgpu.technique_skip_reason("compile", CPU):
        pytest.skip("no torch.compile here")
    compile_model(tiny_net(), Techniques(compile=True), CPU)
    assert seen.get("fullgraph") is True


def test_paired_multiply_add_ratio_is_a_positive_median(monkeypatch):
    times = iter([2.0, 1.0, 3.0, 3.0, 1.0, 2.0])  # add, multiply, add, multiply, ...
    monkeypatch.setattr(P, "_best_seconds", lambda fn, device, **kw: next(times))
    assert P.paired_multiply_add_ratio(CPU, 8, repeats=3) == pytest.approx(1.0)
    monkeypatch.undo()
    assert P.paired_multiply_add_ratio(CPU, 1 << 12, repeats=3) > 0


@pytest.mark.parametrize("native_bf16", [True, False])
def test_on_a_cpu_the_gpu_techniques_are_counted_as_well_as_timed(monkeypatch, native_bf16):
    import itertools

    from d2lgpu import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native_bf16)
    dataloaders, resident = tiny_loaders(n=64, batch=16)
    batches = list(itertools.islice(iter(resident[0]), 4))
    before = dataclasses.replace(Techniques.d2l_style(), device_data=True)
    count = P.count_technique_effect
    # d2l's loop reads the loss and the correct count after every step; no_sync, neither.
    assert count("no_sync", tiny_net, batches, 0.1, CPU, before) == (2, 0)
    # torch's default SGD on a CPU: one add_ per parameter tensor; the fused one: one call.
    ops = count("fused_optimizer", tiny_net, batches, 0.1, CPU, before)
    assert ops == (len(list(tiny_net().parameters())), 1)
    # "auto" is bf16 only where the CPU computes it natively; bf16 activations take half.
    fp32, auto = count("precision", tiny_net, batches, 0.1, CPU, before)
    assert (auto < 0.75 * fp32) if native_bf16 else (auto == fp32)

    plan = P.ablation_plan(CPU, skip={"compile": "slow in tests"})[:3]
    rows = P.run_ablation(plan, train_rows(dataloaders, resident))
    counted = P.count_effects(plan, tiny_net, batches, 0.1, CPU)
    # Counted as well as timed: the row keeps its paired ratios.
    assert counted == {"no_sync": (2, 0)}  # the data-on-device row counts nothing
    assert P.ablation_numbers(rows)[2].x_prev > 0
    table = ablation_benchmark().format_ablation_table(rows, counted=counted).splitlines()
    assert table[-1] == f"  + no per-step sync: {P.COUNT_UNITS['no_sync']} 2 -> 0, counted"
    assert all(len(line) <= 100 for line in table)


@pytest.mark.parametrize("gpu", [True, False])
def test_smoke_mode_ablation_is_full_modes_rows_on_four_batches(monkeypatch, gpu):
    monkeypatch.delenv("D2LGPU_QUICK", raising=False)
    monkeypatch.setenv("D2LGPU_SMOKE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    settings = P.ablation_settings()
    full = P.ablation_settings("full")
    # A GPU's smoke run trains full mode's model; a CPU's, CPU mode's (ResNet-18 is slow there).
    assert settings.model == ("resnet18" if gpu else "small_cnn") and settings.batch_size == 8
    # Four: counting the .item() reads of a step compares epochs of 4 and 2 steps.
    assert settings.train_size // settings.batch_size == 4 and settings.repeats == 1
    # A GPU's smoke run compiles; a CPU's leaves that row out, saying why.
    if not gpu:
        plan = P.ablation_plan("cpu", settings.skip)
        reason = next(step.skip_reason for step in plan if step.technique == "compile")
        assert reason is not None and "smoke mode" in reason
    assert full == settings  # "full" is what smoke mode runs, cut


def test_ablation_data_keeps_the_first_examples_of_the_small_subset(monkeypatch):
    monkeypatch.setenv("D2LGPU_QUICK", "1")
    (train, test), (resident_train, resident_test) = P.ablation_data(
        32, "cpu", train_size=96, test_size=64)
    assert len(train.dataset) == 96 and len(test.dataset) == 64
    assert len(resident_train.labels) == 96 and len(resident_test.labels) == 64
