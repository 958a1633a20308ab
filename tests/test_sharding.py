"""FSDP2 on CPUs (gloo): shards, equality with one process, collectives counted, checkpoints.

The multi-process tests share their launches: one two-rank launch runs the DDP
accumulation job and three FSDP runs, one three-rank launch resumes the first
FSDP run from its checkpoint.
Every launch and subprocess has a timeout.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from d2lgpu.fsdp_train import EntryHooks
from d2lgpu.memory import make_optimizer
from d2lgpu.runtime.checkpoints import (
    CheckpointError,
    Checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from d2lgpu.runtime.distributed import (
    RemoteTraceback,
    find_free_port,
    launch,
    process_group,
)
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
    padded_parameter_bytes,
    sharding_worker,
    train_single,
)

# Each test starts processes (ranks, torchrun, scripts): `pytest` leaves them out, CI runs
# them (pyproject.toml's "slow" marker).
pytestmark = pytest.mark.slow

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
    kw.setdefault("lr", 1e-2)
    return TrainPlan(SHAPE, X, y, batch_size=batch_size, steps=steps, **kw)


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --- in this process ---------------------------------------------------------------------


def test_padding_to_a_multiple_of_the_world_size():
    layer = nn.Linear(5, 3)  # weight 3 x 5, bias 3
    assert padded_parameter_bytes(layer, 1) == 18 * 4
    assert padded_parameter_bytes(layer, 3) == 18 * 4  # 3 rows split evenly
    assert padded_parameter_bytes(layer, 2) == (4 * 5 + 4) * 4  # padded to 4 rows
    formula = collective_formula(layer, 2, reshard_after_forward=True)
    assert formula == {"all_gather": 2 * 96, "reduce_scatter": 96}
    formula = collective_formula(layer, 2, reshard_after_forward=False, param_dtype=torch.bfloat16)
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
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        load_checkpoint(tmp_path / "step-000008", fresh, fresh_optimizer)


def test_a_checkpoint_directory_under_home_is_written_and_found_there(tmp_path, monkeypatch):
    # "~/ck" as a command line passes it (bash leaves the ~ of --checkpoint-dir=~/ck alone)
    monkeypatch.setenv("HOME", str(tmp_path))
    torch.manual_seed(0)
    model = SHAPE.build()
    optimizer = make_optimizer("adam", model.parameters(), lr=1e-2)
    hooks = Checkpoints("~/ck", every=1)
    assert hooks.resume(model, optimizer, None, {}, 3).path is None
    saved = hooks.after_step(1, model, optimizer, None, {}, 3, {"losses": [1.0]})
    assert saved == tmp_path / "ck" / "step-000001" and latest_checkpoint("~/ck") == saved
    assert not (Path.cwd() / "~").exists()
    fresh = SHAPE.build(seed=1)
    resumed = hooks.resume(fresh, make_optimizer("adam", fresh.parameters(), lr=1e-2), None, {}, 3)
    assert (resumed.step, resumed.path) == (1, saved)


def test_resume_latest_restores_model_optimizer_and_scaler_hashing_each_file_once(
    tmp_path, monkeypatch
):
    import d2lgpu.runtime.checkpoints as checkpoints

    model = SHAPE.build()
    optimizer = make_optimizer("sgd_momentum", model.parameters(), lr=1e-2)
    X, y = _plan().global_batch(0)
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    hooks = Checkpoints(str(tmp_path), every=2, config={"precision": "fp16"})
    assert hooks.after_step(1, model, optimizer, scaler, {"lr": 0.01}, 3, {"losses": [2.3]}) is None
    hooks.after_step(2, model, optimizer, scaler, {"lr": 0.01}, 3, {"losses": [2.3, 2.2]})

    fresh = SHAPE.build(seed=1)
    fresh_optimizer = make_optimizer("sgd_momentum", fresh.parameters(), lr=1e-2)
    fresh_scaler = torch.amp.GradScaler("cpu")
    hashed = []
    digests = checkpoints._file_digests
    monkeypatch.setattr(checkpoints, "_file_digests", lambda d: hashed.append(d) or digests(d))
    resumed = hooks.resume(fresh, fresh_optimizer, fresh_scaler, {"lr": 0.01}, 3)
    assert (resumed.step, resumed.extra["losses"]) == (2, [2.3, 2.2]) and len(hashed) == 1
    assert _max_abs_diff(fresh.state_dict(), model.state_dict()) == 0.0
    assert fresh_scaler.get_scale() == 2.0**10
    assert len(fresh_optimizer.state) == len(list(fresh.parameters()))
    with pytest.raises(CheckpointError, match="lr 0.01 in the checkpoint, 0.1 now"):
        hooks.resume(fresh, fresh_optimizer, fresh_scaler, {"lr": 0.1}, 3)
    assert Checkpoints(str(tmp_path / "empty")).resume(fresh, fresh_optimizer, None, {}, 3) == (
        0, {}, None)


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
            # its checkpoints record the settings, to resume from
            FSDPRun(plan, hooks=Checkpoints(str(checkpoints), every=2)),
            FSDPRun(replace(plan, steps=1), reshard_after_forward=False),
            FSDPRun(replace(plan, steps=2), param_dtype=torch.bfloat16),
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
    plan, checkpoints, jobs, (_, full, kept, mixed) = two_ranks
    one = train_single(plan)
    # Every parameter is a DTensor sharded on dim 0; each rank holds half the rows.
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
    for job, result in zip(jobs[1:], (full, kept, mixed), strict=True):
        counted = {kind: stats.nbytes for kind, stats in result.watch[0].comm.items()}
        assert counted == collective_formula(model, 2, param_dtype=job.param_dtype,
                                             reshard_after_forward=job.reshard_after_forward)
    # reshard_after_forward=False keeps the full (padded) parameters from forward to backward.
    assert [w.held_after_forward for w in full.watch] == [0, 0]
    assert [w.held_after_forward for w in kept.watch] == [padded, padded]
    # Mixed precision: bf16 compute and all-gathers, fp32 shards and gradients.
    assert mixed.watch[0].compute_dtype == "bfloat16"
    assert mixed.watch[0].comm["all_gather"].dtypes == {"bfloat16"}
    assert mixed.watch[0].grad_dtype == "float32" == full.watch[0].grad_dtype
    assert full.watch[0].compute_dtype == "float32"
    assert mixed.losses == pytest.approx(one.losses[:2], abs=0.05)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002", "step-000004"]


@needs_fsdp2_on_cpu
def test_three_ranks_resume_the_two_rank_checkpoint_and_a_failing_rank_ends_the_job(
    two_ranks, tmp_path
):
    """One three-rank launch: resume from the two-rank checkpoint (saved again at its end),
    then a job in which rank 1 fails while the others wait for it in a collective."""
    from torch.distributed.checkpoint import FileSystemReader

    plan, checkpoints, _, (_, full, _, _) = two_ranks
    one = train_single(plan)
    shutil.copytree(checkpoints / "step-000002", tmp_path / "step-000002")
    resume = FSDPRun(plan, hooks=Checkpoints(str(tmp_path), every=2))
    failing = FSDPRun(_plan(steps=3), hooks=EntryHooks(None, fail_rank=1, fail_at_step=1))
    started = time.monotonic()
    # A process-group timeout far longer than any launch on a loaded machine: a job that
    # ended only by timing out would take 300 s; launch must end it at once.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        with pytest.raises(RuntimeError, match="rank 1 failed on purpose in step 1") as info:
            launch(
                sharding_worker, 3, (3, find_free_port(), [resume, failing], 300.0), timeout_s=280
            )
    elapsed = time.monotonic() - started
    assert elapsed < 200, f"took {elapsed:.0f} s"
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert any("raised by rank 1 of 3" in note for note in getattr(info.value, "__notes__", []))

    # The resumed run finished before the failing job and saved its last step.
    saved = latest_checkpoint(tmp_path)
    assert saved is not None and saved.name == "step-000004"
    single = SHAPE.build(seed=5)
    optimizer = make_optimizer(plan.optimizer, single.parameters(), lr=plan.lr)
    extra = load_checkpoint(saved, single, optimizer)
    assert extra["world_size"] == 3
    assert extra["losses"][:2] == full.losses[:2]  # the history came from the 2-rank checkpoint
    assert _max_abs_diff(single.state_dict(), one.state_dict) < 1e-4
    # Three ranks held thirds: chunks of ceil(32 / 3) = 11 rows, the last one shorter.
    chunks = FileSystemReader(str(saved)).read_metadata().state_dict_metadata["model.1.weight"]
    assert sorted(tuple(c.sizes) for c in chunks.chunks) == [(10, 20), (11, 20), (11, 20)]

    # One process without a process group loads the sharded 2-rank checkpoint too.
    single = SHAPE.build(seed=5)
    optimizer = make_optimizer(plan.optimizer, single.parameters(), lr=plan.lr)
    load_checkpoint(checkpoints / "step-000002", single, optimizer)
    at_two = train_single(replace(plan, steps=2))
    assert _max_abs_diff(single.state_dict(), at_two.state_dict) < 1e-4
    # a fresh SGD has no state: momentum buffers can only have come from the checkpoint
    assert len(optimizer.state) == len(list(single.parameters()))
    assert all(state["momentum_buffer"].abs().sum() > 0 for state in optimizer.state.values())


# --- torchrun ----------------------------------------------------------------------------


# d2lgpu.fsdp_train under torchrun on two pretend machines, with a crash, a restart and a
# resume from the first epoch's checkpoint, is run and checked by chapter 8's notebook
# (section "torchrun: one machine, and several"), which the same pytest command runs under
# nbval: its six process starts are paid once, there.


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--epochs", "0"], "--epochs"),
        (["--batch-size", "-3"], "--batch-size"),
        (["--lr", "nan"], "--lr"),
        (["--timeout", "inf"], "--timeout"),
        (["--fail-after-epoch", "0"], "--fail-after-epoch"),
        (["--precision", "half"], "--precision"),
        (["--epochs", "3", "--fail-after-epoch", "3", "--checkpoint-dir", "{tmp}"],
         "--fail-after-epoch 3 is not before the run's last epoch (3)"),
    ],
)
def test_fsdp_train_bad_command_line_values_are_usage_errors(argv, flag, tmp_path, capsys):
    from d2lgpu.fsdp_train import _parse_args

    with pytest.raises(SystemExit) as info:
        _parse_args([a.format(tmp=tmp_path / "ckpt") for a in argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    said = flag if " " in flag else f"argument {flag}:"
    assert said in err and "Traceback" not in err, err


# --- faults and bad input, in this process (a one-rank group where FSDP2 needs one) -------


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with process_group(0, 1, master_port=find_free_port(), timeout_s=30) as ctx:
        yield ctx


def test_fsdp_run_names_a_bad_param_dtype():
    for bad in ("bf16", torch.float64):
        with pytest.raises(ValueError, match="param_dtype must be torch.bfloat16, torch.float16"):
            FSDPRun(_plan(), param_dtype=bad)


_DTYPES = {"fp32": None, "tf32": None, "bf16": torch.bfloat16}


def _resumable(plan: TrainPlan, root: Path, precision: str = "fp32", every: int = 2) -> FSDPRun:
    """The command line's run: its checkpoints also record the precision word."""
    hooks = EntryHooks(str(root), every, {"precision": precision})
    return FSDPRun(plan, param_dtype=_DTYPES[precision], hooks=hooks)


@needs_fsdp2_on_cpu
def test_fsdp_run_saves_every_save_every_steps(tmp_path, one_rank):
    run = FSDPRun(_plan(steps=2), hooks=Checkpoints(str(tmp_path), every=1))
    result = run.run(one_rank)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]
    model = SHAPE.build(seed=5)
    optimizer = make_optimizer("sgd_momentum", model.parameters(), lr=1e-2)
    extra = load_checkpoint(latest_checkpoint(tmp_path), model, optimizer)
    assert extra == {"step": 2, "losses": result.losses, "world_size": 1,
                     "config": run.settings()}
    assert _max_abs_diff(model.state_dict(), result.state_dict) == 0.0


@needs_fsdp2_on_cpu
def test_fsdp_train_sets_tf32_while_training_resumes_and_refuses_other_settings(
    tmp_path, monkeypatch, capsys
):
    """The entry point in this process, as torchrun's one rank: the device's policy for
    --precision tf32 (a CUDA device's, here) holds TF32 on while training only; started again
    with more epochs it resumes, with another learning rate it is refused."""
    import d2lgpu.fsdp_train as fsdp_train
    import d2lgpu.sharding as sharding
    from d2lgpu.runtime.checkpoints import CheckpointError

    gen = torch.Generator().manual_seed(0)
    data = {train: (torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=gen),
                    torch.randint(0, 10, (n,), generator=gen)) for train, n in ((True, 48),
                                                                             (False, 12))}
    monkeypatch.setattr("d2lgpu.data.fashion_mnist_tensors",
                        lambda train, root, quick: data[train])
    policy = fsdp_train.precision_policy
    monkeypatch.setattr(fsdp_train, "precision_policy",
                        lambda device, word: replace(policy(device, word), device_type="cuda"))
    seen = []
    train_step = sharding._train_step

    def spy(*args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return train_step(*args, **kwargs)

    monkeypatch.setattr(sharding, "_train_step", spy)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": ""}
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def run(*flags: str):
        monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
        return fsdp_train.main(["--batch-size=12", "--precision=tf32", "--quick",
                                f"--checkpoint-dir={tmp_path}", *flags])

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        first = run("--epochs=1")
        assert seen == ["high"] * 4 and torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    resumed = run("--epochs=2")
    assert f"resuming from {tmp_path / 'step-000004'} (step 4)" in capsys.readouterr().out
    assert resumed.losses[:4] == first.losses and len(resumed.losses) == 8
    with pytest.raises(CheckpointError, match="learning rate 0.001 in the checkpoint, 0.01 now"):
        run("--epochs=3", "--lr=0.01")


def _flip_bytes(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    path.write_bytes(bytes(data))


def _saved_checkpoint(root: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model = SHAPE.build()
    optimizer = make_optimizer("sgd_momentum", model.parameters(), lr=1e-2)
    X, y = _plan().global_batch(0)
    nn.functional.cross_entropy(model(X), y).backward()
    optimizer.step()
    return save_checkpoint(root, 1, model, optimizer), model, optimizer


def test_a_corrupt_shard_is_named_and_not_loaded(tmp_path):
    from d2lgpu.runtime.checkpoints import CheckpointError

    path, model, optimizer = _saved_checkpoint(tmp_path)
    assert (path / "checksums.json").exists()
    load_checkpoint(path, model, optimizer)  # intact: loads
    shard = next(path.glob("*.distcp"))
    _flip_bytes(shard)
    with pytest.raises(CheckpointError, match=f"{shard.name} is missing, added or changed") as info:
        load_checkpoint(path, model, optimizer)
    assert "to start fresh, delete" in str(info.value)


def _three_checkpoints(root: Path) -> tuple[list[Path], nn.Module, torch.optim.Optimizer]:
    model = SHAPE.build()
    optimizer = make_optimizer("sgd_momentum", model.parameters(), lr=1e-2)
    paths = [save_checkpoint(root, step, model, optimizer, {"losses": [2.3] * step})
             for step in (1, 2, 3)]
    return paths, model, optimizer


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "extra.json").write_text(""), "file extra.json is missing, added or changed"),
    (lambda d: (d / "extra.json").unlink(), "file extra.json is missing, added or changed"),
    (lambda d: (d / "stray").write_text(""), "file stray is missing, added or changed"),
    (lambda d: (d / "checksums.json").unlink(), "has no readable checksums.json"),
    (lambda d: (d / "checksums.json").write_text("{"), "has no readable checksums.json"),
    (lambda d: _flip_bytes(next(d.glob("*.distcp"))), r"\.distcp is missing, added or changed"),
])
def test_a_damaged_checkpoint_names_the_file_and_the_newest_intact_one(tmp_path, damage, words):
    from d2lgpu.runtime.checkpoints import CheckpointError, read_checkpoint_extra

    paths, model, optimizer = _three_checkpoints(tmp_path)
    damage(paths[2])
    older = "resume from step-000002, the newest intact checkpoint before it"
    for read in (lambda: read_checkpoint_extra(paths[2]),
                 lambda: load_checkpoint(paths[2], model, optimizer)):
        with pytest.raises(CheckpointError, match=words) as info:
            read()
        assert older in str(info.value) and "to start fresh" in str(info.value)
    # With nothing intact before it, the only way on is named: start fresh.
    damage(paths[0])
    with pytest.raises(CheckpointError, match="No intact checkpoint comes before it"):
        read_checkpoint_extra(paths[0])


def test_loading_into_a_model_of_another_shape_names_the_parameter_and_both_shapes(tmp_path):
    from d2lgpu.runtime.checkpoints import CheckpointError

    path, _, _ = _saved_checkpoint(tmp_path)
    wider = replace(SHAPE, hidden=SHAPE.hidden * 2).build()
    optimizer = make_optimizer("sgd_momentum", wider.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"holds another model: \S+weight is \(\d+, \d+\) "
                                              r"in the checkpoint, \(\d+, \d+\) in this model"):
        load_checkpoint(path, wider, optimizer)


def test_latest_checkpoint_refuses_look_alikes_instead_of_starting_from_scratch(tmp_path):
    from d2lgpu.runtime.checkpoints import CheckpointError

    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-1.tmp").mkdir()
    (tmp_path / ".step-000004.tmp").mkdir()  # a save that crashed: ours, and ignored
    with pytest.raises(CheckpointError, match=r"2 entries that look like checkpoints but are "
                                              r"not \(step-1.tmp, step-abc\)"):
        latest_checkpoint(tmp_path)
    path, _, _ = _saved_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path) == path  # beside a checkpoint, they are left out
    empty = tmp_path / "fresh"
    empty.mkdir()
    (empty / ".step-000001.tmp").mkdir()
    assert latest_checkpoint(empty) is None  # nothing checkpoint-like: a fresh start


def test_a_checkpoint_without_metadata_is_an_error_not_a_fresh_start(tmp_path, one_rank):
    from d2lgpu.runtime.checkpoints import CheckpointError

    path, model, optimizer = _saved_checkpoint(tmp_path)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="has no .metadata"):
        load_checkpoint(path, model, optimizer)
    if NO_FSDP2_ON_CPU is None:  # resuming from the root: refused, not a fresh start
        with pytest.raises(CheckpointError, match="has no .metadata"):
            _resumable(_plan(), tmp_path).run(one_rank)


@needs_fsdp2_on_cpu
def test_resuming_with_other_settings_is_refused_naming_each(tmp_path, one_rank):
    from d2lgpu.runtime.checkpoints import CheckpointError

    plan = _plan(steps=2)
    first = _resumable(plan, tmp_path).run(one_rank)
    changed = [
        (dict(lr=0.1), "learning rate 0.01 in the checkpoint, 0.1 now"),
        (dict(batch_size=24), "global batch size 12 in the checkpoint, 24 now"),
        (dict(optimizer="adam"), "optimizer sgd_momentum in the checkpoint, adam now"),
    ]
    for change, words in changed:
        with pytest.raises(CheckpointError, match=words):
            _resumable(replace(plan, steps=4, **change), tmp_path).run(one_rank)
    with pytest.raises(CheckpointError, match="compute dtype float32 in the checkpoint, bfloat16 "
                                              "now; precision fp32 in the checkpoint, bf16 now"):
        _resumable(replace(plan, steps=4), tmp_path, "bf16").run(one_rank)
    # tf32 computes in fp32 too, but it is another setting: refused as well.
    with pytest.raises(CheckpointError, match="precision fp32 in the checkpoint, tf32 now"):
        _resumable(replace(plan, steps=4), tmp_path, "tf32").run(one_rank)
    with pytest.raises(CheckpointError, match="at step 2 and this run ends at step 2"):
        _resumable(plan, tmp_path).run(one_rank)
    resumed = _resumable(replace(plan, steps=3), tmp_path).run(one_rank)
    assert resumed.losses[:2] == first.losses and len(resumed.losses) == 3  # more steps: allowed


@needs_fsdp2_on_cpu
@pytest.mark.parametrize("lr", [100.0, 1e6])
def test_fsdp_stops_when_training_diverges(tmp_path, one_rank, lr):
    run = FSDPRun(_plan(steps=6, optimizer="adam", lr=lr), hooks=Checkpoints(str(tmp_path), 3))
    with pytest.raises(FloatingPointError, match="diverged"):
        run.run(one_rank)
    assert latest_checkpoint(tmp_path) is None  # stopped before saving the diverged weights


def test_nan_in_the_data_is_named_before_training():
    X = torch.randn(24, 20)
    X[3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"images hold 1 NaN value\(s\)\. Find the broken"):
        TrainPlan(SHAPE, X, torch.zeros(24, dtype=torch.long), batch_size=12, steps=1)


def test_checkpoint_paths_are_checked_before_training(tmp_path, capsys):
    from d2lgpu.fsdp_train import _parse_args
    from d2lgpu.runtime.checkpoints import CheckpointError, prepare_checkpoint_root

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for bad, words in ((a_file / "ckpt", "is a regular file, not a directory"),
                       (a_file, "is a file, not a directory")):
        with pytest.raises(CheckpointError, match=words):
            prepare_checkpoint_root(bad)
    with pytest.raises(CheckpointError, match="cannot write checkpoints: .* is under /proc"):
        prepare_checkpoint_root("/proc/d2lgpu-checkpoints")
    assert prepare_checkpoint_root(tmp_path / "new" / "dir").is_dir()
    with pytest.raises(SystemExit) as info:
        _parse_args([f"--checkpoint-dir={a_file / 'ckpt'}"])
    assert info.value.code == 2
    assert "argument --checkpoint-dir: cannot write checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: TrainPlan(SHAPE, None, torch.zeros(3), batch_size=1, steps=1), "images must"),
        (lambda: TrainPlan(SHAPE, torch.zeros(3, 20), [0, 1, 2], batch_size=1, steps=1), "labels"),
        (lambda: TrainPlan("mlp", torch.zeros(3, 20), torch.zeros(3), 1, 1), "MLPShape"),
        (lambda: _plan(lr=float("nan")), "lr must be"),
        (lambda: _plan(optimizer="lbfgs"), "optimizer must be one of"),
        (lambda: _plan(shuffle="no"), "shuffle must be True or False"),
        (lambda: MLPShape(width="32"), "width must be a positive int"),
        (lambda: FSDPRun(None), "plan must be a TrainPlan"),
        (lambda: FSDPRun(_plan(), reshard_after_forward="no"), "True or False"),
        (lambda: AccumulationRun(None, 2), "plan must be a TrainPlan"),
        (lambda: train_single(None), "plan must be a TrainPlan"),
        (lambda: padded_parameter_bytes(None, 2), "model must be a torch.nn.Module"),
    ],
)
def test_bad_input_to_sharding_names_the_fix(call, words):
    with pytest.raises((TypeError, ValueError), match=words):
        call()


@needs_fsdp2_on_cpu
def test_fp16_precision_scales_the_loss(one_rank):
    # fp16 (a T4's or V100's choice) on the CPU: the same code path, with a loss scaler.
    result = FSDPRun(_plan(steps=2), param_dtype=torch.float16).run(one_rank)
    assert result.watch[0].compute_dtype == "float16"
    assert result.watch[0].grad_dtype == "float32"
    assert all(math.isfinite(v) for v in result.losses)


@pytest.mark.parametrize("device_type", [None, "gpu"])
def test_fsdp2_availability_names_a_bad_device_type(device_type):
    with pytest.raises(ValueError, match="device_type"):
        fsdp2_unavailable_reason(device_type)


def test_an_empty_checkpoint_dir_is_a_usage_error(capsys):
    from d2lgpu.fsdp_train import _parse_args

    with pytest.raises(SystemExit) as info:
        _parse_args(["--checkpoint-dir="])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("argument --checkpoint-dir: cannot write checkpoints: the checkpoint directory must "
            "be a path") in err
