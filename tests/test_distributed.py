"""torch.distributed on CPU (gloo): process groups, the spawn launcher, DDP training, torchrun.

The multi-process tests start real processes, so each costs seconds (mostly the
import of torch in every new process). Every launch and subprocess has a timeout.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _torchrun import CHILD_ENV, two_node_torchrun

from d2lgpu.ddp_demos import faulty_worker, hogwild_train
from d2lgpu.ddp_train import (
    DDPConfig,
    build_model,
    ddp_worker,
    strip_batchnorm,
    train_ddp,
)
from d2lgpu.runtime.checkpoints import latest_checkpoint, read_checkpoint_extra
from d2lgpu.runtime.distributed import (
    DistContext,
    RemoteTraceback,
    all_reduce_sum,
    choose_backend,
    find_free_port,
    launch,
    process_group,
    run_together,
)

# Each test starts processes (ranks, torchrun, scripts): `pytest` leaves them out, CI runs
# them (pyproject.toml's "slow" marker).
pytestmark = pytest.mark.slow


def _synthetic_images(n_train: int = 96, n_test: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n_train + n_test, 1, 28, 28), generator=gen, dtype=torch.uint8)
    y = torch.randint(0, 10, (n_train + n_test,), generator=gen)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# --- backend choice and process groups (in this process) ------------------------------


def test_choose_backend_needs_one_gpu_per_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert choose_backend(2) == "nccl"
    assert choose_backend(3) == "gloo"  # a third rank would share a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend(1) == "gloo"
    with pytest.raises(ValueError, match="positive int"):
        choose_backend(0)


def test_process_group_without_torchrun_env_names_the_fix(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"), process_group():
        pass
    with pytest.raises(ValueError, match="find_free_port"), process_group(0, 2):
        pass
    with (
        pytest.raises(ValueError, match="rank < world_size"),
        process_group(2, 2, master_port=1234),
    ):
        pass
    assert not dist.is_initialized()


def test_nccl_without_a_gpu_per_rank_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with (
        pytest.raises(RuntimeError, match="one GPU per process"),
        process_group(0, 1, master_port=find_free_port(), backend="nccl"),
    ):
        pass
    assert not dist.is_initialized()


def test_process_group_is_destroyed_even_after_an_error():
    with (
        pytest.raises(KeyError),
        process_group(0, 1, master_port=find_free_port(), timeout_s=20) as ctx,
    ):
        assert dist.is_initialized() and ctx.backend == "gloo" and ctx.is_main
        assert all_reduce_sum([1.5, 2.0], ctx) == [1.5, 2.0]  # one rank: the sum is itself
        raise KeyError("boom")
    assert not dist.is_initialized()


def test_launch_refuses_functions_a_spawned_process_cannot_import():
    def local_worker(rank: int) -> int:
        return rank

    with pytest.raises(ValueError, match="move it into a .py module"):
        launch(local_worker, 2)
    with pytest.raises(ValueError, match="nprocs"):
        launch(faulty_worker, 0)


# --- training in one process (resume: test_ddp_train.py) --------------------------------


def test_strip_batchnorm_removes_every_batchnorm():
    from d2lgpu.models import small_cnn

    net = strip_batchnorm(small_cnn())
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules())
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_global_batch_must_split_evenly():
    # The check comes before any collective, so a context without a real group suffices.
    ctx = DistContext(
        rank=0,
        world_size=3,
        local_rank=0,
        local_world_size=3,
        backend="gloo",
        device=torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="multiple of 3"):
        train_ddp(DDPConfig(batch_size=32), ctx, _synthetic_images(), build_model("small_cnn"))


# --- several processes through the launcher --------------------------------------------


def test_ddp_on_two_ranks_matches_one_process_on_the_full_batch(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the spawned ranks use gloo on CPUs
    data = _synthetic_images()
    # No batch norm: it normalises with local-batch statistics, which DDP does not average.
    cfg = DDPConfig(epochs=2, batch_size=32, lr=0.1, log=False)
    two = launch(ddp_worker, 2, (2, find_free_port(), cfg, "small_cnn_nobn", data, 30.0),
                 timeout_s=180)
    torch.manual_seed(cfg.seed)  # the initial weights ddp_worker builds on every rank
    one = train_ddp(cfg, None, data, build_model("small_cnn_nobn"))
    assert two.world_size == 2 and two.backend == "gloo" and two.num_epochs == 2
    diff = _max_abs_diff(two.state_dict, one.state_dict)
    assert diff < 1e-5, f"DDP and single-process weights differ by {diff}"
    # The parameters moved (otherwise equality would prove nothing).
    torch.manual_seed(cfg.seed)
    assert _max_abs_diff(build_model("small_cnn_nobn").state_dict(), one.state_dict) > 1e-3
    assert two.train_loss == pytest.approx(one.train_loss, rel=1e-5)


@pytest.mark.multigpu
def test_ddp_with_nccl_on_two_gpus_matches_one_process_on_the_full_batch():
    data = _synthetic_images()
    # Strict fp32, TF32 off in both runs (cuDNN convolutions use it by default from Ampere on): its
    # 10-bit mantissa alone can move the weights by more than the tolerance.
    cfg = DDPConfig(epochs=2, batch_size=32, lr=0.1, log=False, precision="fp32")
    two = launch(ddp_worker, 2, (2, find_free_port(), cfg, "small_cnn_nobn", data, 60.0),
                 timeout_s=300)
    torch.manual_seed(cfg.seed)
    one = train_ddp(cfg, None, data, build_model("small_cnn_nobn"), torch.device("cuda", 0))
    assert two.backend == "nccl" and two.num_epochs == 2
    # Looser than on the CPU: cuDNN may choose other convolution algorithms per batch size.
    diff = _max_abs_diff(two.state_dict, one.state_dict)
    assert diff < 1e-3, f"DDP (NCCL) and single-GPU weights differ by {diff}"


# Not forced onto the CPU: on a machine with two GPUs this is the NCCL failure path,
# where the failing rank must not wait for its stuck peer while leaving the group.
def test_a_failing_rank_ends_the_job_with_its_error_quickly():
    started = time.monotonic()
    with pytest.raises(ValueError, match="rank 1 found a bad batch") as info:
        # The process-group timeout (30 s) is the slow way out; launch must be faster.
        launch(faulty_worker, 2, (2, find_free_port(), 1, 30.0), timeout_s=120)
    elapsed = time.monotonic() - started
    assert elapsed < 60, f"took {elapsed:.0f} s"
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "in faulty_worker" in cause.text
    assert any("raised by rank 1 of 2" in note for note in getattr(info.value, "__notes__", []))


def test_hogwild_updates_the_shared_model_in_the_caller():
    gen = torch.Generator().manual_seed(0)
    true_w = torch.tensor([[2.0], [-3.0]])
    X = torch.randn(400, 2, generator=gen)
    y = X @ true_w + 1.0
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    before = model.weight.detach().clone()
    hogwild_train(model, X, y, nprocs=2, epochs=3, batch_size=10, lr=0.1, timeout_s=120)
    # Only the child processes trained; the caller's tensors changed because they are shared.
    assert model.weight.is_shared()
    assert not torch.equal(model.weight.detach(), before)
    assert torch.allclose(model.weight.detach(), true_w.T, atol=0.05)
    assert abs(model.bias.item() - 1.0) < 0.05


def test_hogwild_refuses_mismatched_data():
    with pytest.raises(ValueError, match="feature rows"):
        hogwild_train(torch.nn.Linear(2, 1), torch.zeros(4, 2), torch.zeros(3, 1))


# --- torchrun --------------------------------------------------------------------------


def test_torchrun_on_two_nodes_trains_one_job_that_only_global_rank_0_reports(tmp_path):
    # Two pretend machines (c10d rendezvous on the loopback), one process each: both
    # processes have LOCAL_RANK 0, and only the global rank 0 may log. A crash, a restart
    # and the resume from the checkpoint under torchrun are run and checked by chapter 5's
    # notebook (section "torchrun: the same training from the command line"), which the
    # same pytest command runs under nbval.
    checkpoints = tmp_path / "checkpoints"
    port = find_free_port()
    nodes = run_together(
        [
            two_node_torchrun(node, port)
            + ["-m", "d2lgpu.ddp_train", "--quick", "--epochs=2", "--batch-size=64",
               f"--checkpoint-dir={checkpoints}", "--timeout=60"]
            for node in (0, 1)
        ],
        env=CHILD_ENV,
        timeout_s=300,
    )
    outputs = [node.output for node in nodes]
    combined = "".join(outputs)
    assert [node.returncode for node in nodes] == [0, 0], "\n---\n".join(outputs)[-4000:]
    # One job of two ranks (one per "node"); only global rank 0 logs.
    assert combined.count("2 ranks, backend gloo") == 1, combined[-3000:]
    assert combined.count("epoch 2/2") == 1 and combined.count("done: 2 epochs") == 1
    saved = read_checkpoint_extra(latest_checkpoint(checkpoints))
    assert saved["step"] == 2 and len(saved["history"]["train_loss"]) == 2
    assert saved["config"]["--model"] == "small_cnn"  # quick mode picks the small model


# --- DataParallel against DDP: the counts and the verdicts on them ----------------------

def test_busiest_gpu_bytes_counts_both_wrappers():
    from d2lgpu.ddp_demos import busiest_gpu_bytes

    counts = busiest_gpu_bytes(1000, 4, input_bytes=400, output_bytes=40, buffer_bytes=8)
    # DataParallel, all through GPU 0: broadcast of parameters and buffers, reduce of the
    # gradients, 3/4 of the input scattered out, 3/4 of the outputs gathered in and their
    # gradient scattered back.
    assert counts["DataParallel"] == 1000 + 8 + 1000 + 0.75 * (400 + 2 * 40)
    # DDP: the ring all-reduce's 2(N - 1)/N of the gradients, and rank 0's buffers.
    assert counts["DDP"] == 2 * 0.75 * 1000 + 8
    # The parameter terms alone differ by N/(N - 1), whatever the model.
    for n in (2, 4, 8):
        alone = busiest_gpu_bytes(1000, n)
        assert alone["DataParallel"] / alone["DDP"] == pytest.approx(n / (n - 1))
    one = busiest_gpu_bytes(1000, 1, input_bytes=400, output_bytes=40, buffer_bytes=8)
    assert one == {"DataParallel": 0, "DDP": 0}
    with pytest.raises(ValueError, match="whole number"):
        busiest_gpu_bytes(-1, 2)
    with pytest.raises(ValueError, match="buffer_bytes"):
        busiest_gpu_bytes(1000, 2, buffer_bytes=1.5)


def test_launch_preloads_what_every_rank_would_import_again(monkeypatch):
    """The forkserver imports torch, torch._dynamo (a process's first optimizer imports it:
    seconds in every rank otherwise) and the launched function's module, once."""
    import torch.multiprocessing as mp

    from d2lgpu.runtime import distributed

    preloads = []

    class Context:
        def set_forkserver_preload(self, modules):
            preloads.append(list(modules))

    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["fork", "spawn", "forkserver"])
    monkeypatch.setattr(mp, "get_context", lambda method: Context())
    assert distributed._rank_start_method(faulty_worker) == "forkserver"
    assert preloads[-1] == ["torch", "torch._dynamo", "d2lgpu.runtime.distributed",
                            "d2lgpu.ddp_demos"]

    def in_main(rank):
        return rank

    in_main.__module__ = "__main__"  # a script's function: the server cannot import it by name
    distributed._rank_start_method(in_main)
    assert preloads[-1] == ["torch", "torch._dynamo", "d2lgpu.runtime.distributed"]
    from d2lgpu.sharding import sharding_worker

    distributed._rank_start_method(sharding_worker)
    assert preloads[-1][-1] == "d2lgpu.sharding"
    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])  # Windows
    assert distributed._rank_start_method(sharding_worker) == "spawn"
