"""d2lgpu.ddp_train without a process group: settings, checkpoints and the command line.

All in this process on small synthetic tensors (seconds in all); the
multi-process runs are in test_distributed.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from d2lgpu import ddp_train
from d2lgpu.ddp_train import DDPConfig, main, train_ddp
from d2lgpu.runtime.checkpoints import CheckpointError, latest_checkpoint, read_checkpoint_extra

COMMON = dict(batch_size=32, lr=0.1, seed=0, log=False)


def _model(name: str = "small_cnn") -> torch.nn.Module:
    torch.manual_seed(0)
    return ddp_train.build_model(name)


def _images(n_train: int = 64, n_test: int = 32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n_train + n_test, 1, 28, 28), generator=gen, dtype=torch.uint8)
    y = torch.randint(0, 10, (n_train + n_test,), generator=gen)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


# --- settings -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, name",
    [
        ({"lr": math.inf}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"lr": -0.1}, "lr"),
        ({"seed": -5}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"epochs": 0}, "epochs"),
    ],
)
def test_bad_settings_are_refused_by_name(change, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        DDPConfig(**{**COMMON, **change})


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--epochs", "-1"], "--epochs"),
        (["--batch-size", "0"], "--batch-size"),
        (["--seed", "-5"], "--seed"),
        (["--lr", "inf"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "0"], "--timeout"),
        (["--fail-after-epoch", "0"], "--fail-after-epoch"),
        (["--precision", "half"], "--precision"),
        (["--fail-after-epoch", "1"], "--fail-after-epoch needs --checkpoint-dir"),
        (["--checkpoint-dir", "/proc/d2lgpu/ckpt"], "--checkpoint-dir"),
        # a crash after the last epoch: the restart would find nothing left to train
        (["--epochs", "2", "--fail-after-epoch", "2", "--checkpoint-dir", "{tmp}"],
         "--fail-after-epoch 2 is not before the run's last epoch (2)"),
    ],
)
def test_bad_command_line_values_are_usage_errors(argv, flag, tmp_path, capsys):
    # --data-root is a file: whatever gets past the checks fails at once instead of training.
    not_a_directory = tmp_path / "file"
    not_a_directory.touch()
    with pytest.raises(SystemExit) as info:
        main([*(a.format(tmp=tmp_path / "ckpt") for a in argv), "--data-root",
              str(not_a_directory)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err, err


def test_bad_precision_is_refused_naming_the_words():
    with pytest.raises(ValueError, match="precision=False is not one of 'auto', 'fp32', 'tf32', "
                                         "'fp16', 'bf16'"):
        DDPConfig(**COMMON, precision=False)


def _precision_on_cuda(monkeypatch):
    """Train on the CPU with the precision policy a CUDA device would get for the same word."""
    policy = ddp_train.precision_policy
    monkeypatch.setattr(
        ddp_train,
        "precision_policy",
        lambda device, precision: dataclasses.replace(
            policy(device, precision), device_type="cuda"
        ),
    )


@pytest.mark.parametrize(
    "precision, during", [("fp32", ("highest", False)), ("tf32", ("high", True))]
)
def test_precision_sets_tf32_during_training_on_cuda_and_restores_it(
    precision, during, monkeypatch
):
    seen = []
    epoch = ddp_train._epoch

    def spy(*args, **kwargs):
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))
        return epoch(*args, **kwargs)

    _precision_on_cuda(monkeypatch)
    monkeypatch.setattr(ddp_train, "_epoch", spy)
    previous = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    opposite = ("high", True) if precision == "fp32" else ("highest", False)
    torch.set_float32_matmul_precision(opposite[0])
    torch.backends.cudnn.allow_tf32 = opposite[1]
    try:
        train_ddp(DDPConfig(epochs=1, precision=precision, **COMMON), None, _images(), _model())
        assert seen == [during, during]  # the training pass and the test pass
        assert torch.get_float32_matmul_precision() == opposite[0]
        assert torch.backends.cudnn.allow_tf32 is opposite[1]
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_trains_under_autocast_and_fp16_scales_the_loss(
    precision, dtype, monkeypatch
):
    seen = []
    epoch = ddp_train._epoch

    def spy(net, loader, device, policy, optimizer=None, scaler=None):
        if optimizer is not None:
            seen.append((policy.dtype, scaler.is_enabled()))
        return epoch(net, loader, device, policy, optimizer, scaler)

    monkeypatch.setattr(ddp_train, "_epoch", spy)
    # One batch of 32: enough to run the autocast path (fp16 is slow on a CPU).
    cfg = DDPConfig(epochs=1, precision=precision, **COMMON)
    result = train_ddp(cfg, None, _images(32, 8), _model())
    assert seen == [(dtype, precision == "fp16")]
    assert math.isfinite(result.train_loss[0])


# --- training that goes wrong -------------------------------------------------------------


def test_a_loss_that_grows_tenfold_in_the_first_epoch_is_divergence(monkeypatch):
    # The first epoch's mean is measured against the first step's loss, not against itself:
    # a run that blows up within epoch 1 stops there, finite or not.
    class GrowingLoss(torch.nn.CrossEntropyLoss):
        calls = 0

        def forward(self, logits, target):
            GrowingLoss.calls += 1
            return super().forward(logits, target) * (1 if GrowingLoss.calls == 1 else 1000)

    monkeypatch.setattr(ddp_train.nn, "CrossEntropyLoss", GrowingLoss)
    with pytest.raises(FloatingPointError,
                       match=r"more than 10 times the .* in epoch 1 \(steps 1-2\): training "
                             r"diverged at lr 0\.1"):
        train_ddp(DDPConfig(epochs=2, **COMMON), None, _images(), _model())


@pytest.mark.parametrize("which", ["train", "test"])
def test_an_empty_data_set_is_refused_before_training(which):
    x_train, y_train, x_test, y_test = _images()
    if which == "train":
        x_train, y_train = x_train[:0], y_train[:0]
    else:
        x_test, y_test = x_test[:0], y_test[:0]
    with pytest.raises(ValueError, match=rf"the {which} set needs images .* got 0 images"):
        train_ddp(DDPConfig(epochs=1, **COMMON), None, (x_train, y_train, x_test, y_test),
                  _model())


def test_nan_in_the_data_is_named_before_training():
    x_train, *rest = _images()
    x_train = x_train.float()
    x_train[5, 0, 3, 3] = math.nan
    with pytest.raises(ValueError, match=r"train images hold nan or inf"):
        train_ddp(DDPConfig(epochs=1, **COMMON), None, (x_train, *rest), _model())


def test_settings_of_the_wrong_type_are_refused_by_name():
    with pytest.raises(TypeError, match=r"^log must be"):
        DDPConfig(**{**COMMON, "log": "no"})


def test_train_ddp_refuses_a_model_name_where_it_takes_the_model():
    with pytest.raises(TypeError, match=r"model must be an nn.Module \(e.g. build_model\("
                                        r"'small_cnn'\)\), got str"):
        train_ddp(DDPConfig(**COMMON), None, _images(), "small_cnn")


def test_train_ddp_refuses_data_that_is_not_four_tensors():
    with pytest.raises(TypeError, match="data must be a tuple of 4 tensors"):
        train_ddp(DDPConfig(**COMMON), None, [1, 2], _model())


# --- the command line: checkpoints and resume ---------------------------------------------


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """Run the command line in this process (no torchrun: one process, on the CPU) on
    synthetic images, with a checkpoint directory; returns (run, checkpoint directory)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(ddp_train, "try_gpu", lambda: torch.device("cpu"))
    train, test = _images()[:2], _images()[2:]
    monkeypatch.setattr("d2lgpu.data.fashion_mnist_tensors",
                        lambda train, root, quick: train_set if train else test_set)
    train_set, test_set = train, test
    root = tmp_path / "ckpt"

    def run(*flags, checkpoints=True):
        argv = ["--batch-size=32", "--model=small_cnn", *flags]
        argv += [] if "--full" in flags else ["--quick"]
        return main(argv + ([f"--checkpoint-dir={root}"] if checkpoints else []))

    return run, root


def test_a_resumed_run_continues_exactly_as_one_without_a_crash(cli, capsys):
    run, root = cli
    with pytest.raises(RuntimeError, match="simulated failure of rank 0 after epoch 1"):
        run("--epochs=2", "--fail-after-epoch=1")
    assert latest_checkpoint(root).name == "step-000001"
    resumed = run("--epochs=2")
    assert f"resuming from {root / 'step-000001'} after epoch 1" in capsys.readouterr().out
    straight = run("--epochs=2", checkpoints=False)
    assert resumed.resumed_from_epoch == 1 and resumed.num_epochs == 2
    assert resumed.train_loss[0] == straight.train_loss[0]  # epoch 1 came from the checkpoint
    for name, tensor in straight.state_dict.items():
        assert torch.allclose(resumed.state_dict[name], tensor, atol=1e-6), name
    extra = read_checkpoint_extra(latest_checkpoint(root))
    assert extra["step"] == 2 and extra["history"]["train_loss"] == resumed.train_loss


def test_resuming_with_other_settings_is_refused_naming_each(cli):
    run, root = cli
    run("--epochs=1")
    written = {p.name: p.read_bytes() for p in latest_checkpoint(root).iterdir()}
    with pytest.raises(CheckpointError) as info:
        run("--epochs=2", "--lr=0.05", "--batch-size=16", "--seed=3", "--full",
            "--precision=bf16", "--model=resnet18")
    message = str(info.value)
    assert str(root) in message
    for difference in ("--lr 0.1 in the checkpoint, 0.05 now",
                       "--batch-size 32 in the checkpoint, 16 now",
                       "--seed 0 in the checkpoint, 3 now",
                       "--quick True in the checkpoint, False now",
                       "--precision fp32 in the checkpoint, bf16 now",
                       "--model small_cnn in the checkpoint, resnet18 now"):
        assert difference in message, message
    assert "--epochs" not in message  # only the settings that must match
    assert "delete" in message and "another checkpoint directory" in message
    assert written == {p.name: p.read_bytes() for p in latest_checkpoint(root).iterdir()}


@pytest.mark.parametrize("epochs", [1, 2])
def test_no_more_epochs_than_the_checkpoint_holds_is_refused(cli, epochs):
    run, _ = cli
    run("--epochs=2")
    with pytest.raises(CheckpointError, match=rf"is at step 2 and this run ends at step {epochs}: "
                                              r"nothing is left to train"):
        run(f"--epochs={epochs}")


def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(cli, monkeypatch):
    run, root = cli
    run("--epochs=1")

    class InfiniteLoss(torch.nn.CrossEntropyLoss):
        def forward(self, logits, target):
            return super().forward(logits, target) * math.inf

    monkeypatch.setattr(ddp_train.nn, "CrossEntropyLoss", InfiniteLoss)
    with pytest.raises(FloatingPointError, match=r"became (nan|inf) in epoch 2 \(steps 3-4\)"):
        run("--epochs=2")
    assert latest_checkpoint(root).name == "step-000001"


def test_a_damaged_checkpoint_is_refused_on_the_command_line_with_the_message_alone(
    cli, capsys
):
    run, root = cli
    run("--epochs=1")
    shard = next(latest_checkpoint(root).glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    capsys.readouterr()
    status = ddp_train.command_line(["--batch-size=32", "--model=small_cnn", "--quick",
                                     "--epochs=2", f"--checkpoint-dir={root}"])
    err = capsys.readouterr().err
    assert status == 1
    assert f"d2lgpu.ddp_train: error: checkpoint {root / 'step-000001'}" in err, err
    assert "checksums" in err and "to start fresh" in err and "Traceback" not in err, err
