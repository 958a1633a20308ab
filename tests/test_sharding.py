"""FSDP2 on CPUs (gloo): shards, equality with one process, collectives counted, checkpoints.

The multi-process tests share their launches: one two-rank launch runs the DDP
accumulation job and three FSDP runs, one three-rank launch resumes the first
FSDP run from its checkpoint.
Every launch and subprocess has a timeout.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from _torchrun import CHILD_ENV, two_node_torchrun
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from d2lgpu.distributed import (
    RemoteTraceback,
    find_free_port,
    launch,
    process_group,
    run_together,
)
from d2lgpu.memory import make_optimizer
from d2lgpu.sharding import (
    ACCUMULATION_VARIANTS,
    AccumulationRun,
    CollectiveCounter,
    CommStats,
    FSDPRun,
    MLPShape,
    TrainPlan,
    collective_formula,
    counting_allreduce_hook,
    fsdp2_unavailable_reason,
    latest_checkpoint,
    load_checkpoint,
    padded_parameter_bytes,
    save_checkpoint,
    sharding_worker,
    train_single,
)

NO_FSDP2_ON_CPU = fsdp2_unavailable_reason("cpu")
needs_fsdp2_on_cpu = pytest.mark.skipif(NO_FSDP2_ON_CPU is not None, reason=str(NO_FSDP2_ON_CPU))

SHAPE = MLPShape(width=32, hidden=64, depth=2, in_features=20, num_classes=5)


def _plan(steps: int = 4, batch_size: int = 12, **kw) -> TrainPlan:
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(96, 20, generator=gen)
    y = torch.randint(0, 5, (96,), generator=gen)
    # SGD with momentum, not Adam: Adam's first steps move every weight by about lr
    # whatever the gradient's size, so rounding differences between a sharded and an
    # unsharded run (another reduction order) can flip a step; momentum keeps them tiny.
    kw.setdefault("optimizer", "sgd_momentum")
    return TrainPlan(SHAPE, X, y, batch_size=batch_size, steps=steps, lr=1e-2, **kw)


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --- in this process ---------------------------------------------------------------------


def test_padding_to_a_multiple_of_the_world_size():
    layer = nn.Linear(5, 3)  # weight 3 x 5, bias 3
    assert padded_parameter_bytes(layer, 1) == 18 * 4
    assert padded_parameter_bytes(layer, 3) == 18 * 4  # 3 rows split evenly
    assert padded_parameter_bytes(layer, 2) == (4 * 5 + 4) * 4  # padded to 4 rows
    formula = collective_formula(layer, 2, reshard_after_forward=True, mixed_precision=False)
    assert formula == {"all_gather": 2 * 96, "reduce_scatter": 96}
    formula = collective_formula(layer, 2, reshard_after_forward=False, mixed_precision=True)
    assert formula == {"all_gather": 48, "reduce_scatter": 96}


def test_local_batches_make_up_the_global_batch_for_any_world_size():
    plan = _plan(shuffle=True)
    for step in (0, 7, 8):  # 8 steps per epoch: step 8 starts a new, reshuffled epoch
        X, y = plan.global_batch(step)
        for world in (1, 2, 3):
            parts = [plan.local_batch(step, r, world) for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), X)
            assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert plan.steps_per_epoch == 8
    assert not torch.equal(plan.global_batch(0)[0], plan.global_batch(8)[0])
    assert torch.equal(plan.global_batch(3)[0], plan.global_batch(3)[0])
    with pytest.raises(ValueError, match="multiple of 5"):
        plan.local_batch(0, 0, 5)
    with pytest.raises(ValueError, match="labels"):
        TrainPlan(SHAPE, torch.zeros(3, 20), torch.zeros(2), batch_size=1, steps=1)


def test_fsdp2_availability_names_the_version(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.0")  # gloo sums gradients (#162338)
    assert "torch >= 2.9" in fsdp2_unavailable_reason("cpu")
    assert "summed the gradients" in fsdp2_unavailable_reason("cpu")
    assert fsdp2_unavailable_reason("cuda") is None or "2.4" in fsdp2_unavailable_reason("cuda")


def test_checkpoint_round_trip_in_one_process(tmp_path):
    plan = _plan(steps=3)
    torch.manual_seed(0)
    model = SHAPE.build()
    optimizer = make_optimizer("adam", model.parameters(), lr=1e-2)
    for step in range(plan.steps):
        X, y = plan.global_batch(step)
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    # A crash in the middle of writing leaves a temporary directory; it never counts.
    (tmp_path / ".step-000009.tmp").mkdir()
    (tmp_path / "step-000008").mkdir()  # no .metadata: incomplete, ignored as well
    path = save_checkpoint(tmp_path, 3, model, optimizer, {"note": "three steps"})
    assert path.name == "step-000003" and latest_checkpoint(tmp_path) == path
    assert not list(tmp_path.glob(".step-000003*"))
    save_checkpoint(tmp_path, 3, model, optimizer)  # saving a step again replaces it
    assert latest_checkpoint(tmp_path) == path

    fresh = SHAPE.build(seed=1)
    fresh_optimizer = make_optimizer("adam", fresh.parameters(), lr=1e-2)
    extra = load_checkpoint(path, fresh, fresh_optimizer)
    assert extra["step"] == 3
    assert _max_abs_diff(fresh.state_dict(), model.state_dict()) == 0.0
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], fresh_optimizer.state[q][key])
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step-000008", fresh, fresh_optimizer)


def test_counters_see_collectives_and_ddp_buckets():
    with process_group(0, 1, master_port=find_free_port(), timeout_s=20):
        with CollectiveCounter() as counter:
            torch.distributed.all_reduce(torch.ones(10))
            torch.distributed.all_gather_into_tensor(torch.empty(4), torch.ones(4))
        assert counter.stats["all_reduce"].calls == 1
        assert counter.stats["all_reduce"].nbytes == 40
        assert counter.stats["all_gather"].nbytes == 16

        torch.manual_seed(0)
        ddp = DistributedDataParallel(SHAPE.build())
        stats = CommStats()
        ddp.register_comm_hook(stats, counting_allreduce_hook)
        X, y = _plan().global_batch(0)
        with ddp.no_sync():
            nn.functional.cross_entropy(ddp(X), y).backward()
        assert stats.calls == 0  # no_sync: gradients stay local
        nn.functional.cross_entropy(ddp(X), y).backward()
        assert stats.nbytes == sum(p.numel() * 4 for p in ddp.parameters())
        assert stats.dtypes == {"float32"}
        # Drop DDP while the group is still registered: if its reducer held the gloo
        # group's last reference, freeing it (with the GIL held) would join gloo's
        # threads, which need the GIL: torch 2.8 hangs there.
        del ddp


# --- several processes: one two-rank launch for several tests ---------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of two ranks: DDP accumulation, and (where FSDP2 runs on CPUs) three FSDP runs."""
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    plan = _plan(steps=4)
    jobs: list = [AccumulationRun(replace(plan, steps=3, batch_size=16, optimizer="sgd"), 4)]
    if NO_FSDP2_ON_CPU is None:
        jobs += [
            FSDPRun(plan, checkpoint_root=str(checkpoints), save_every=2),
            FSDPRun(replace(plan, steps=1), reshard_after_forward=False),
            FSDPRun(replace(plan, steps=2), mixed_precision=True),
        ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # the spawned ranks use gloo on CPUs
        results = launch(sharding_worker, 2, (2, find_free_port(), jobs, 60.0), timeout_s=240)
    return plan, checkpoints, jobs, results


def test_ddp_no_sync_all_reduces_once_per_step(two_ranks):
    _, _, jobs, results = two_ranks
    plan, result = jobs[0].plan, results[0]
    every, last = (result.comm[v] for v in ACCUMULATION_VARIANTS)
    param_bytes = sum(p.numel() * 4 for p in SHAPE.build().parameters())
    assert every.nbytes == 3 * 4 * param_bytes  # every micro-batch of every step
    assert last.nbytes == 3 * param_bytes  # once per step
    assert every.calls == 4 * last.calls
    states = [result.state_dicts[v] for v in ACCUMULATION_VARIANTS]
    assert _max_abs_diff(*states) < 1e-6
    assert _max_abs_diff(states[1], train_single(plan).state_dict) < 1e-4


@needs_fsdp2_on_cpu
def test_fsdp_on_two_ranks_shards_and_matches_one_process(two_ranks):
    plan, _, _, (_, full, kept, mixed) = two_ranks
    one = train_single(plan)
    # Every parameter is a DTensor sharded on dim 0; each rank holds half the rows.
    assert full.world_size == 2 and full.backend == "gloo"
    for shard in full.shards:
        assert shard.placements == "(Shard(dim=0),)"
        assert shard.local_shape[0] == (shard.global_shape[0] + 1) // 2
    model = SHAPE.build()
    padded = padded_parameter_bytes(model, 2)
    assert padded > sum(p.numel() * 4 for p in model.parameters())  # 5 classes: 1 padded row
    assert full.parameter_bytes == [padded // 2] * 2
    assert full.optimizer_bytes[0] >= padded // 2  # momentum: one buffer per shard
    assert [w.gradient_bytes for w in full.watch] == [padded // 2] * 2
    # The same training as one process on the whole batch, and training did move the weights.
    assert _max_abs_diff(full.state_dict, one.state_dict) < 1e-4
    assert _max_abs_diff(full.state_dict, SHAPE.build().state_dict()) > 1e-3
    assert full.losses == pytest.approx(one.losses, rel=1e-5)
    # Collectives of one step, counted on rank 0, equal the formula.
    for result in (full, kept, mixed):
        counted = {kind: stats.nbytes for kind, stats in result.watch[0].comm.items()}
        assert counted == result.comm_formula
    # reshard_after_forward=False keeps the full (padded) parameters from forward to backward.
    assert [w.held_after_forward for w in full.watch] == [0, 0]
    assert [w.held_after_forward for w in kept.watch] == [padded, padded]
    # Mixed precision: bf16 compute and all-gathers, fp32 shards and gradients.
    assert mixed.watch[0].compute_dtype == "bfloat16"
    assert mixed.watch[0].comm["all_gather"].dtypes == {"bfloat16"}
    assert mixed.watch[0].grad_dtype == "float32" == full.watch[0].grad_dtype
    assert full.watch[0].compute_dtype == "float32"
    assert mixed.losses == pytest.approx(one.losses[:2], abs=0.05)
    assert [Path(p).name for p in full.saved] == ["step-000002", "step-000004"]


@needs_fsdp2_on_cpu
def test_three_ranks_and_one_process_resume_the_two_rank_checkpoint(two_ranks):
    plan, checkpoints, _, (_, full, _, _) = two_ranks
    one = train_single(plan)
    resume = FSDPRun(plan, resume_from=str(checkpoints / "step-000002"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        (three,) = launch(sharding_worker, 3, (3, find_free_port(), [resume], 60.0), timeout_s=240)
    assert three.world_size == 3 and three.start_step == 2
    assert three.losses[:2] == full.losses[:2]  # the history came from the checkpoint
    assert _max_abs_diff(three.state_dict, one.state_dict) < 1e-4
    rows = {s.name: s for s in three.shards}
    assert rows["1.weight"].global_shape == (32, 20)
    assert rows["1.weight"].local_shape == (11, 20)  # chunks of ceil(32 / 3) rows on rank 0
    assert three.parameter_bytes == [padded_parameter_bytes(SHAPE.build(), 3) // 3] * 3

    # One process without a process group loads the sharded checkpoint too.
    single = SHAPE.build(seed=5)
    optimizer = make_optimizer(plan.optimizer, single.parameters(), lr=plan.lr)
    load_checkpoint(checkpoints / "step-000002", single, optimizer)
    at_two = train_single(replace(plan, steps=2))
    assert _max_abs_diff(single.state_dict(), at_two.state_dict) < 1e-4
    # a fresh SGD has no state: momentum buffers can only have come from the checkpoint
    assert len(optimizer.state) == len(list(single.parameters()))
    assert all(state["momentum_buffer"].abs().sum() > 0 for state in optimizer.state.values())


@needs_fsdp2_on_cpu
def test_a_failing_rank_ends_the_fsdp_job_with_its_error_quickly(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    run = FSDPRun(_plan(steps=3), fail_rank=1, fail_at_step=1)
    started = time.monotonic()
    # The process-group timeout (30 s) is the slow way out; launch must be faster.
    with pytest.raises(RuntimeError, match="rank 1 failed on purpose in step 1") as info:
        launch(sharding_worker, 2, (2, find_free_port(), [run], 30.0), timeout_s=120)
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert any("raised by rank 1 of 2" in note for note in getattr(info.value, "__notes__", []))


# --- torchrun ----------------------------------------------------------------------------


@needs_fsdp2_on_cpu
def test_torchrun_two_nodes_restart_and_resume_from_the_checkpoint(tmp_path):
    port = find_free_port()
    checkpoints = tmp_path / "checkpoints"
    nodes = run_together(
        [
            two_node_torchrun(node, port)
            + [
                "--max-restarts=1",
                "-m",
                "d2lgpu.fsdp_train",
                "--quick",
                "--epochs=2",
                "--batch-size=250",
                "--width=32",
                "--hidden=64",
                "--depth=2",
                f"--checkpoint-dir={checkpoints}",
                "--fail-after-epoch=1",
                "--timeout=60",
            ]
            for node in (0, 1)
        ],
        env=CHILD_ENV,
    )
    outputs = [node.output for node in nodes]
    combined = "\n---\n".join(outputs)
    assert [node.returncode for node in nodes] == [0, 0], combined[-4000:]
    assert "rank 1 failed on purpose in step 2" in combined  # after epoch 1 (2 steps)
    assert f"resuming from {checkpoints / 'step-000002'} (step 2)" in combined
    assert combined.count("done: 4 steps") == 1  # one job of two ranks; rank 0 reports
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000004"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--epochs", "0"], "--epochs"),
        (["--width", "-3"], "--width"),
        (["--lr", "nan"], "--lr"),
        (["--timeout", "inf"], "--timeout"),
        (["--fail-after-epoch", "0"], "--fail-after-epoch"),
    ],
)
def test_fsdp_train_bad_command_line_values_are_usage_errors(argv, flag, capsys):
    from d2lgpu.fsdp_train import _parse_args

    with pytest.raises(SystemExit) as info:
        _parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "Traceback" not in err, err
