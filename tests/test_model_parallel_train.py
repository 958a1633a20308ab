"""model_parallel_train, chapter 9's torchrun entry point: killed, resumed on another mesh.

One test pays for two torchrun launches of 2 gloo ranks: the first, on a (2, 1) mesh, has
a rank killed in step 5, after the checkpoint of step 4; the second resumes on a (1, 2) mesh. The
rest (flags, refusals, precision) runs in this process, in a one-rank group.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace

import pytest
import torch
from _torchrun import CHILD_ENV, TORCHRUN

from d2lgpu.model_parallel import ModelSpec, TwoDRun, max_abs_diff, train_reference
from d2lgpu.model_parallel_train import EntryHooks
from d2lgpu.runtime.checkpoints import CheckpointError, load_checkpoint
from d2lgpu.runtime.distributed import find_free_port, process_group
from d2lgpu.sharding import fsdp2_unavailable_reason

# Each test starts processes (ranks, torchrun, scripts): `pytest` leaves them out, CI runs
# them (pyproject.toml's "slow" marker).
pytestmark = pytest.mark.slow

NO_FSDP2_ON_CPU = fsdp2_unavailable_reason("cpu")
needs_fsdp2_on_cpu = pytest.mark.skipif(NO_FSDP2_ON_CPU is not None, reason=str(NO_FSDP2_ON_CPU))

SPEC = ModelSpec(width=32, hidden=64, depth=2)
LR, BATCH, SEQ, STEPS = 0.05, 4, 4, 6
FLAGS = [
    "--width=32", "--hidden=64", "--depth=2", f"--batch-size={BATCH}", f"--seq-len={SEQ}",
    f"--lr={LR}", "--precision=fp32", f"--steps={STEPS}", "--save-every=2", "--timeout=60",
]
TOL = 1e-5


def _torchrun(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        TORCHRUN + ["--standalone", "--nproc_per_node=2", "-m", "d2lgpu.model_parallel_train",
                    *FLAGS, *flags],
        env=CHILD_ENV, capture_output=True, text=True, timeout=240,
    )


@needs_fsdp2_on_cpu
def test_killed_on_a_2x1_mesh_and_resumed_on_1x2_equals_one_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    killed = _torchrun("--dp=2", "--tp=1", f"--checkpoint-dir={ckpt}", "--fail-after-epoch=2")
    out = killed.stdout + killed.stderr
    assert killed.returncode != 0, out[-3000:]
    assert "rank 1 is killed (SIGKILL) in step 5, after its forward" in out, out[-3000:]
    assert "mesh (dp, tp) = (2, 1)" in out
    # Complete checkpoints only: no temporary directory, nothing after the kill.
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000002", "step-000004"]

    resumed = _torchrun("--dp=1", "--tp=2", f"--checkpoint-dir={ckpt}")
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert f"resuming from {ckpt / 'step-000004'} (step 4)" in out
    assert "written on a mesh (dp, tp) = (2, 1), this run has (1, 2)" in out
    assert f"done: {STEPS} steps" in out

    # One process, no process group, loads the final checkpoint the (1, 2) mesh wrote.
    model = SPEC.build(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    extra = load_checkpoint(ckpt / f"step-{STEPS:06d}", model, optimizer)
    ref = train_reference(SPEC, batch_size=BATCH, seq_len=SEQ, steps=STEPS, lr=LR)
    diff = max_abs_diff(model.state_dict(), ref.state_dict)
    print(f"killed in step 5 on (2, 1), resumed on (1, 2): max |weight - one process| = "
          f"{diff:.1e} (tolerance {TOL:g})")
    assert diff < TOL
    assert extra["mesh"] == [1, 2] and extra["step"] == STEPS
    assert extra["losses"] == pytest.approx(ref.losses, abs=TOL)  # 4 from the first job


# --- flags: usage errors that name the fix, without starting processes --------------------


@pytest.mark.parametrize(
    "argv, world_size, words",
    [
        (["--dp=2", "--tp=2"], 2, r"shape \(2, 2\) has 4 places but there are 2 ranks"),
        (["--tp=3"], 3, "256 hidden units do not split over 3 tensor-parallel ranks"),
        (["--kind=attention", "--tp=3"], 3, "4 heads do not split over 3"),
        (["--batch-size=5", "--tp=1"], 2, "batch of 5 does not split over 2 data-parallel"),
        (["--kind=attention", "--width=30"], None, "width 30 does not split into 4 heads"),
        (["--precision=half"], None, "invalid choice: 'half'"),
        (["--steps=0"], None, "argument --steps: must be a positive int"),
        (["--seed=-1"], None, "argument --seed"),
        (["--fail-after-epoch=1"], None, "--fail-after-epoch needs --checkpoint-dir"),
        # an epoch here is --save-every steps: 40 steps of 10 have epochs 1 to 3 to crash after
        (["--steps=40", "--save-every=10", "--fail-after-epoch=4", "--checkpoint-dir=ckpt"],
         None, r"--fail-after-epoch 4 is not before the run's last epoch \(4\)"),
        # 45 steps: a crash after epoch 4 (step 40) comes in step 41 and leaves 41-45 to resume
        (["--steps=45", "--save-every=10", "--fail-after-epoch=5", "--checkpoint-dir=ckpt"],
         None, r"--fail-after-epoch 5 is not before the run's last epoch \(5\)"),
        (["--data-root=x"], None, "unrecognized arguments: --data-root"),  # synthetic data
    ],
)
def test_bad_flags_are_usage_errors_naming_the_fix(argv, world_size, words, capsys):
    from d2lgpu.model_parallel_train import _parse_args

    with pytest.raises(SystemExit) as info:
        _parse_args(argv, world_size)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(words, err), err


@pytest.mark.parametrize(
    "argv, world_size, mesh",
    [
        ([], 4, (2, 2)),
        (["--batch-size=12"], 3, (3, 1)),
        (["--tp=4"], 4, (1, 4)),
        (["--dp=1"], 2, (1, 2)),
    ],
)
def test_the_mesh_defaults_fill_in_what_is_not_given(argv, world_size, mesh, tmp_path):
    from d2lgpu.model_parallel_train import _parse_args

    for more in ([], [f"--checkpoint-dir={tmp_path}"]):
        _, job = _parse_args([*argv, *more], world_size)
        assert isinstance(job, TwoDRun) and job.mesh_shape == mesh


def test_outside_torchrun_main_says_how_to_start_it(monkeypatch):
    from d2lgpu.model_parallel_train import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="start it with torchrun"):
        main(["--dp=1", "--tp=1"])


# --- resuming under other settings, in a one-rank group ----------------------------------


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with process_group(0, 1, master_port=find_free_port(), timeout_s=30) as ctx:
        yield ctx


def _resumable(run: TwoDRun, root, every: int, precision: str = "fp32") -> TwoDRun:
    """The command line's run: its checkpoints also record the precision word."""
    return replace(run, hooks=EntryHooks(str(root), every, {"precision": precision}))


@needs_fsdp2_on_cpu
def test_resuming_with_other_settings_is_refused_naming_each(tmp_path, one_rank):
    base = TwoDRun(SPEC, (1, 1), batch_size=BATCH, seq_len=SEQ, steps=2, lr=LR)
    first = _resumable(base, tmp_path, 2).run(one_rank)
    changed = [
        (dict(lr=0.1), "learning rate 0.05 in the checkpoint, 0.1 now"),
        (dict(batch_size=8), "global batch size 4 in the checkpoint, 8 now"),
        (dict(spec=replace(SPEC, depth=4)), r"model \(kind, width, hidden, depth, heads, norm\)"),
        (dict(seed=1), "seed 0 in the checkpoint, 1 now"),
        (dict(param_dtype=torch.bfloat16), "precision fp32 in the checkpoint, bf16 now"),
    ]
    for change, words in changed:
        name = "bf16" if "param_dtype" in change else "fp32"
        run = _resumable(replace(base, steps=4, **change), tmp_path, 2, name)
        with pytest.raises(CheckpointError, match=words) as info:
            run.run(one_rank)
        assert "Rerun with the checkpoint's settings" in str(info.value)
    with pytest.raises(CheckpointError, match="at step 2 and this run ends at step 2"):
        _resumable(base, tmp_path, 2).run(one_rank)
    resumed = _resumable(replace(base, steps=3), tmp_path, 2).run(one_rank)
    ref = train_reference(SPEC, batch_size=BATCH, seq_len=SEQ, steps=3, lr=LR)
    assert resumed.losses[:2] == first.losses  # the history came from the checkpoint
    assert max_abs_diff(resumed.state_dict, ref.state_dict) < TOL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]


@needs_fsdp2_on_cpu
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16),
                                              ("fp16 + GradScaler", torch.float16)])
def test_low_precision_computes_in_it_and_keeps_fp32_weights(precision, dtype, one_rank,
                                                             tmp_path):
    run = TwoDRun(SPEC, (1, 1), batch_size=BATCH, seq_len=SEQ, steps=2, lr=LR, param_dtype=dtype)
    result = _resumable(run, tmp_path, 2, precision).run(one_rank)
    ref = train_reference(SPEC, batch_size=BATCH, seq_len=SEQ, steps=2, lr=LR)
    assert all(v.dtype == torch.float32 for v in result.state_dict.values())
    # Close to fp32, but not equal: the matmuls ran in 16 bits.
    assert result.losses == pytest.approx(ref.losses, abs=0.05)
    assert result.losses != ref.losses
    extra = json.loads((tmp_path / "step-000002" / "extra.json").read_text())
    assert extra["config"]["precision"] == precision
    assert ("scaler" in extra) == (dtype == torch.float16)


@needs_fsdp2_on_cpu
def test_a_damaged_extra_json_is_named_with_the_step_to_resume_from(tmp_path, one_rank):
    # Damage is checked before the settings: never "does not record the settings".
    base = TwoDRun(SPEC, (1, 1), batch_size=BATCH, seq_len=SEQ, steps=3, lr=LR)
    _resumable(base, tmp_path, 1).run(one_rank)
    extra = tmp_path / "step-000003" / "extra.json"
    for damage in (lambda: extra.write_text(""), extra.unlink):
        damage()
        with pytest.raises(CheckpointError, match=r"file extra\.json is (empty|missing)") as info:
            _resumable(replace(base, steps=4), tmp_path, 1).run(one_rank)
        assert "Delete " in str(info.value) and "resume from step-000002" in str(info.value)


@needs_fsdp2_on_cpu
def test_a_loss_that_explodes_but_stays_finite_stops_at_the_step_it_grew_tenfold(
    tmp_path, one_rank
):
    # lr=100 on a tiny model: the losses go 2.5, 1.2e4, 8e17, inf. The rule stops step 2,
    # not step 4 where the float ran out.
    run = TwoDRun(ModelSpec(width=8, hidden=8, depth=1), (1, 1), batch_size=2, seq_len=2,
                  steps=3, lr=100.0)
    with pytest.raises(FloatingPointError,
                       match=r"more than 10 times the .* in step 2: training diverged at lr 100"):
        _resumable(run, tmp_path, 1).run(one_rank)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]


@needs_fsdp2_on_cpu
def test_a_diverging_run_stops_before_saving_the_diverged_weights(tmp_path, one_rank):
    run = TwoDRun(SPEC, (1, 1), batch_size=BATCH, seq_len=SEQ, steps=4, lr=1e30)
    with pytest.raises(FloatingPointError, match="diverged.*try 1e[+]29"):
        _resumable(run, tmp_path, 1).run(one_rank)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]
