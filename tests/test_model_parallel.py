"""Model parallelism on CPUs (gloo): pipeline, tensor parallel and 2-D equal one process.

The multi-process checks share one launch of 4 ranks (pipeline with 4 stages, tensor
parallel on a 4-rank mesh, FSDP2 x TP on a 2x2 mesh); the rest runs in this process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import d2lgpu.model_parallel as model_parallel
from d2lgpu.model_parallel import (
    BubbleRun,
    FixedCostRun,
    FixedCostStage,
    ModelSpec,
    PipelineRun,
    ScheduleTiming,
    TensorParallelRun,
    TwoDRun,
    bubble_formula,
    check_mesh,
    check_microbatches,
    check_stages,
    max_abs_diff,
    param_bytes_2d,
    plot_pipeline_timeline,
    split_stages,
    split_table,
    train_reference,
)
from d2lgpu.runtime.distributed import DistContext, find_free_port, launch
from d2lgpu.sharding import fsdp2_unavailable_reason, sharding_worker

# Each test starts processes (ranks, torchrun, scripts): `pytest` leaves them out, CI runs
# them (pyproject.toml's "slow" marker).
pytestmark = pytest.mark.slow

SPEC = ModelSpec(width=32, hidden=64, depth=4)
ATTENTION = ModelSpec(width=32, depth=4, kind="attention", heads=4)
NORMED = ModelSpec(width=32, hidden=64, depth=4, norm=True)
ACT = 4 * 8 * 32 * 4  # batch x sequence x width x 4 bytes
TOL = 1e-5


# --- in this process ---------------------------------------------------------------------


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="at most 4 ranks or a deeper model"):
        check_stages(n_layers=4, n_stages=8)
    with pytest.raises(ValueError, match="multiple of 4"):
        check_stages(n_layers=6, n_stages=4)
    with pytest.raises(ValueError, match=r"divides it \(\[1, 2, 4, 8, 16\]\)"):
        check_microbatches(batch_size=16, n_microbatches=3)
    with pytest.raises(ValueError, match="product is 4"):
        check_mesh((2, 3), world_size=4)
    with pytest.raises(ValueError, match="multiple of 3"):
        PipelineRun(batch_size=16, n_microbatches=3)
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineRun(schedule="zero-bubble")
    assert check_stages(8, 4) == 2 and check_microbatches(16, 4) == 4
    assert check_mesh([2, 2], 4) == (2, 2)


def test_a_pipeline_needs_as_many_microbatches_as_stages():
    ctx = DistContext(0, 4, 0, 4, "gloo", torch.device("cpu"))
    run = PipelineRun(batch_size=4, n_microbatches=2)
    with pytest.raises(ValueError, match="at least 4 microbatches.*use more microbatches"):
        model_parallel._schedule([nn.Linear(2, 2)], run.schedule, run.n_microbatches, ctx)


def test_bubble_formula_and_stage_split():
    assert bubble_formula(1, 5) == 0
    assert bubble_formula(2, 1) == 0.5
    assert bubble_formula(4, 29) == pytest.approx(3 / 32)
    model = SPEC.build()
    stages = split_stages(model, 2)
    # A slice keeps the layers' names, so the stages' state dicts make up the model's.
    merged = {k: v for stage in stages for k, v in stage.state_dict().items()}
    assert max_abs_diff(merged, model.state_dict()) == 0.0


def test_saved_activations_are_counted_and_freed():
    layer = nn.Linear(8, 8)
    counter = model_parallel._SavedPeak(layer.parameters())
    with counter:
        x = torch.randn(5, 8, requires_grad=True)
        out = torch.tanh(layer(x))  # linear saves its input, tanh its output
        assert counter.live == 2 * 5 * 8 * 4
        out.sum().backward()
    del out
    assert counter.live == 0 and counter.peak == 2 * 5 * 8 * 4


def test_2d_bytes_formula_and_split_table():
    # fc1 and fc2's weight split 4 ways; fc1's bias 4 ways; fc2's bias only over "dp".
    per_block = (64 * 32 + 64 + 32 * 64) * 4 // 4 + 32 * 4 // 2
    assert param_bytes_2d(SPEC, 2, 2) == 4 * per_block
    rows = split_table(params=1e9, width=1024, layers=8, tokens=1000, n=8, tp=4)
    ddp, fsdp, _, tp, _ = rows
    assert ddp.memory_gb == 16 and fsdp.memory_gb == 2
    assert fsdp.traffic_gb == pytest.approx(1.5 * ddp.traffic_gb)
    assert tp.traffic_gb == pytest.approx(4 * 8 * 2 * 1000 * 1024 * 2 * 7 / 8 / 1e9)
    text = {row.name: row.traffic for row in split_table()}
    assert text["data parallel (DDP)"].endswith("2bP(N-1)/N")
    assert text["tensor parallel"].startswith("4L all-reduces of bTW")
    with pytest.raises(ValueError, match="together"):
        split_table(params=1e9)
    with pytest.raises(ValueError, match="divisor of 8"):
        split_table(params=1e9, width=1, layers=1, tokens=1, n=8, tp=3)


def test_torch29_first_exchange_is_sent_as_float():
    from torch.distributed.pipelining import PipelineStage

    class Op:
        def __init__(self, tensor):
            self.tensor = tensor

    class OldStage(PipelineStage):  # torch 2.9: int64 sent into a float32 buffer
        def __init__(self):  # no process group needed to test the patch
            pass

        def _get_init_p2p_neighbors_ops(self):
            return [Op(torch.tensor(3)), Op(torch.zeros(1))]

    class NewStage(PipelineStage):  # later torch: no such exchange, nothing to change
        def __init__(self):
            pass

    fix = model_parallel._fix_torch29_first_exchange
    ops = fix(OldStage())._get_init_p2p_neighbors_ops()
    assert [op.tensor.dtype for op in ops] == [torch.float32, torch.float32]
    assert ops[0].tensor.item() == 3.0
    if not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):
        new = NewStage()
        assert fix(new) is new


def test_schedule_formulas():
    def formula(schedule, p, m):
        return ScheduleTiming(schedule, p, 1.0, [m], [1.0], [[]]).formula[0]

    assert formula("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert formula("1f1b", 4, 29) == pytest.approx(3 / 32)
    # Interleaved, two stages per rank: (p - 1) / (v m + p - 1).
    assert formula("interleaved-1f1b", 2, 4) == pytest.approx(1 / 9)
    # Zero-bubble: W fills the gaps, a third of 1F1B's idle time: (p - 1) / (3 v m + p - 1).
    assert formula("interleaved-zero-bubble", 2, 4) == pytest.approx(1 / 25)
    with pytest.raises(ValueError, match="schedule must be one of"):
        FixedCostRun(schedule="dualpipe")


def _two_rank_gpipe_timing() -> ScheduleTiming:
    # GPipe, 2 ranks, m = 2, unit 1 s, F = I = W = 1: the ideal timeline, 9 s long.
    events = [
        (0, 0, "F", 0, 0, 1), (0, 0, "F", 1, 1, 2),
        (1, 1, "F", 0, 1, 2), (1, 1, "F", 1, 2, 3),
        (1, 1, "I", 0, 3, 4), (1, 1, "W", 0, 4, 5), (1, 1, "I", 1, 5, 6), (1, 1, "W", 1, 6, 7),
        (0, 0, "I", 0, 5, 6), (0, 0, "W", 0, 6, 7), (0, 0, "I", 1, 7, 8), (0, 0, "W", 1, 8, 9),
    ]
    events = [(r, s, k, m, float(a), float(b) + 0.001 * (b < 9)) for r, s, k, m, a, b in events]
    return ScheduleTiming("gpipe", 2, 1.0, [2], [9.0], [events])


def test_schedule_timing_reads_the_bubble_from_the_timeline():
    timing = _two_rank_gpipe_timing()
    assert timing.formula == [pytest.approx(1 / 3)]
    assert timing.idle_fraction == [pytest.approx(1 / 3, abs=0.001)]
    assert timing.bubble_fraction[0] == pytest.approx(1 / 3, abs=0.01)
    assert abs(timing.bubble_fraction[0] - timing.formula[0]) < 0.01


def test_pipeline_timeline_plot_has_one_bar_per_piece_of_work():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plot_pipeline_timeline(_two_rank_gpipe_timing(), 0, plt.subplots()[1])
    assert len(ax.collections) == 12


def test_fixed_cost_stage_records_forward_input_and_weight_work():
    stage = FixedCostStage(0, 0.002, 0.003, 0.004)
    x = torch.ones(2, 4)  # the first stage: its input needs no gradient, I still runs
    out = stage(x)
    assert torch.equal(out, x)
    out.sum().backward()
    kinds = sorted(k for _, k, _, _ in stage.events)
    assert kinds == ["F", "I", "W"]
    for _, kind, start, end in stage.events:
        assert end - start >= {"F": 0.002, "I": 0.003, "W": 0.004}[kind] * 0.999
    assert stage.anchor.grad is not None and stage.weight.grad is not None


def test_fixed_cost_work_waits_for_its_input_on_the_host_before_its_cost(monkeypatch):
    # Under NCCL an irecv's Work.wait() makes only the stream wait: the host must sync the
    # device before a sleep stands for the stage's work, or the bubble reads about 0.
    order = []
    monkeypatch.setattr(model_parallel, "synchronize", lambda device: order.append("sync"))
    monkeypatch.setattr(model_parallel.time, "sleep", lambda s: order.append("sleep"))
    stage = FixedCostStage(0, 0.0, 0.0, 0.0)
    out = stage(torch.ones(2, 4))
    assert order == ["sync", "sleep"]  # F: the input first, then the cost
    order.clear()
    out.sum().backward()
    # I and W each wait for their gradient before their cost.
    assert order == ["sync", "sleep", "sync", "sleep"]


def test_timed_stage_synchronizes_its_device_and_pairs_each_backward(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    fake = torch.device("cuda", 1)
    stage = model_parallel._TimedStage(nn.Linear(4, 4), 3, fake)
    outs = [stage(torch.ones(2, 4)) for _ in range(2)]
    for out in outs:
        out.sum().backward()
    # Every time stamp waits for the stage's own device, not the current one.
    assert calls and set(calls) == {fake}
    events = stage.events
    assert [(i, k) for i, k, _, _ in events] == [(3, "F"), (3, "F"), (3, "B"), (3, "B")]
    assert all(a <= b for _, _, a, b in events)
    # Each backward ends with its own last weight gradient, after it starts and before the
    # next one starts.
    assert events[2][2] < events[2][3] <= events[3][2]
    calls.clear()
    model_parallel._TimedStage(nn.Linear(4, 4), 0, torch.device("cpu"))(torch.ones(1, 4))
    assert calls == []


def test_schedule_timing_reads_piece_times_from_its_timeline():
    events = [(0, 0, "F", 0, 0.0, 1.0), (0, 0, "F", 1, 1.0, 2.5), (0, 0, "B", 0, 4.0, 5.0),
              (0, 0, "B", 1, 5.0, 6.0), (1, 1, "F", 0, 1.0, 2.0), (1, 1, "F", 1, 2.5, 3.0),
              (1, 1, "B", 0, 3.0, 4.0), (1, 1, "B", 1, 4.0, 5.0)]
    result = ScheduleTiming("gpipe", 2, float("nan"), [2], [6.0], [events])
    assert result.idle_fraction == [pytest.approx(1 / 3)]
    assert result.piece_seconds(0, "F") == [[1.0, 1.5], [1.0, 0.5]]


# --- one launch of 4 ranks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def four_ranks():
    if fsdp2_unavailable_reason("cpu"):
        pytest.skip(fsdp2_unavailable_reason("cpu"))
    pipe = dict(spec=SPEC, batch_size=8, seq_len=4, n_microbatches=4, steps=2)
    tp = dict(batch_size=4, seq_len=8, steps=2)
    jobs = [
        PipelineRun(schedule="gpipe", **pipe),
        PipelineRun(schedule="1f1b", **pipe),
        TensorParallelRun(spec=SPEC, **tp),
        TensorParallelRun(spec=ATTENTION, **tp),
        TensorParallelRun(spec=NORMED, sequence_parallel=True, **tp),
        TwoDRun(spec=SPEC, mesh_shape=(2, 2), batch_size=4, seq_len=8, steps=2),
        FixedCostRun(schedule="1f1b", n_microbatches=(4,), unit_s=0.004, repeats=1),
        FixedCostRun(schedule="interleaved-1f1b", n_microbatches=(4,), unit_s=0.004, repeats=1),
        FixedCostRun(schedule="interleaved-zero-bubble", n_microbatches=(4,), unit_s=0.004,
                     repeats=1),
        BubbleRun(spec=SPEC, microbatch_size=2, seq_len=4, n_microbatches=(4,), repeats=1),
    ]
    return launch(sharding_worker, 4, (4, find_free_port(), jobs), timeout_s=240)


def test_pipeline_equals_one_process_and_1f1b_keeps_fewer_activations(four_ranks):
    gpipe, onef = four_ranks[:2]
    ref = train_reference(SPEC, batch_size=8, seq_len=4, steps=2, lr=0.05)
    for run in (gpipe, onef):
        assert max_abs_diff(run.state_dict, ref.state_dict) < TOL
        assert run.losses == pytest.approx(ref.losses, abs=TOL)
    # GPipe: every stage holds all 4 microbatches; 1F1B: stage s of 4 holds 4 - s.
    for s in range(4):
        ratio = onef.extra["activation_peak"][s] / gpipe.extra["activation_peak"][s]
        assert ratio == (4 - s) / 4


def test_tensor_parallel_equals_one_process_with_counted_collectives(four_ranks):
    mlp, attention, seq = four_ranks[2:5]
    for run, spec in ((mlp, SPEC), (attention, ATTENTION), (seq, NORMED)):
        ref = train_reference(spec, batch_size=4, seq_len=8, steps=2, lr=0.05)
        assert max_abs_diff(run.state_dict, ref.state_dict) < TOL
        assert run.losses == pytest.approx(ref.losses, abs=TOL)
    # One all-reduce per block forward; backward one per column-wise layer, but not for the
    # first block, whose input (the batch) needs no gradient.
    assert mlp.extra["comm"] == {"all_reduce": (7, 7 * ACT)}
    assert attention.extra["comm"] == {"all_reduce": (4 + 3 * 3, 13 * ACT)}
    assert seq.extra["comm"] == {"all_gather": (8, 8 * ACT), "reduce_scatter": (8, 8 * ACT)}


def test_2d_equals_one_process_with_a_quarter_of_the_parameters(four_ranks):
    two_d = four_ranks[5]
    ref = train_reference(SPEC, batch_size=4, seq_len=8, steps=2, lr=0.05)
    assert max_abs_diff(two_d.state_dict, ref.state_dict) < TOL
    assert two_d.extra["bytes_per_rank"] == [(param_bytes_2d(SPEC, 2, 2),) * 2] * 4


def test_fixed_cost_pipelines_record_every_piece_of_work(four_ranks):
    for timing, stages_per_rank in ((four_ranks[6], 1), (four_ranks[7], 2), (four_ranks[8], 2)):
        (events,) = timing.events
        assert timing.n_ranks == 4 and timing.n_microbatches == [4]
        for rank in range(4):
            mine = [e for e in events if e[0] == rank]
            # F, I and W once per microbatch on each of the rank's stages
            assert len(mine) == 3 * 4 * stages_per_rank
            assert {e[1] for e in mine} == {rank + 4 * k for k in range(stages_per_rank)}
        assert 0 < timing.idle_fraction[0] < 1
        assert 0 <= timing.bubble_fraction[0] <= timing.idle_fraction[0]


def test_real_pipeline_stages_record_every_piece_inside_the_step(four_ranks):
    bubble = four_ranks[9]
    (events,), (step,) = bubble.events, bubble.step_seconds
    for rank in range(4):
        mine = sorted((a, b, k) for r, _, k, _, a, b in events if r == rank)
        assert [k for *_, k in mine].count("F") == 4 and [k for *_, k in mine].count("B") == 4
        # one rank's pieces follow each other and lie inside the step: idle is never < 0
        assert all(b0 <= a1 for (_, b0, _), (a1, _, _) in zip(mine, mine[1:], strict=False))
        assert 0 <= mine[0][0] and mine[-1][1] <= step
    assert 0 < bubble.idle_fraction[0] < 1


@pytest.mark.parametrize("make, name", [
    (lambda: ModelSpec(width="64"), "width"),
    (lambda: ModelSpec(hidden=None), "hidden"),
    (lambda: ModelSpec(depth=-1), "depth"),
    (lambda: ModelSpec(heads=float("nan")), "heads"),
    (lambda: ModelSpec(kind="conv"), "kind"),
    (lambda: ModelSpec(width=30, kind="attention"), "heads"),
    (lambda: split_table(width=1024), "params"),
])
def test_model_settings_and_split_table_refuse_bad_values_by_name(make, name):
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert name in str(info.value), str(info.value)
