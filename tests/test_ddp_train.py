"""d2lgpu.ddp_train without a process group: settings, snapshots and the command line.

All in this process on small synthetic tensors (seconds in all); the
multi-process runs are in test_distributed.py.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

import pytest
import torch

from d2lgpu import ddp_train
from d2lgpu.ddp_train import DDPConfig, SnapshotError, main, read_snapshot, train_ddp
from d2lgpu.training import History

COMMON = dict(batch_size=32, lr=0.1, model="small_cnn", seed=0, quick=True, log=False)


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
        ({"fail_after_epoch": 0}, "fail_after_epoch"),
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
    ],
)
def test_bad_command_line_values_are_usage_errors(argv, flag, tmp_path, capsys):
    # --data-root is a file: whatever gets past the checks fails at once instead of training.
    not_a_directory = tmp_path / "file"
    not_a_directory.touch()
    with pytest.raises(SystemExit) as info:
        main([*argv, "--data-root", str(not_a_directory)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "Traceback" not in err, err


def test_bad_precision_is_refused_naming_the_word_to_write():
    with pytest.raises(ValueError, match="precision=False is not one of .*write precision='fp32'"):
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
    count_correct = ddp_train._count_correct

    def spy(*args, **kwargs):
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))
        return count_correct(*args, **kwargs)

    _precision_on_cuda(monkeypatch)
    monkeypatch.setattr(ddp_train, "_count_correct", spy)
    previous = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    opposite = ("high", True) if precision == "fp32" else ("highest", False)
    torch.set_float32_matmul_precision(opposite[0])
    torch.backends.cudnn.allow_tf32 = opposite[1]
    try:
        train_ddp(DDPConfig(epochs=1, precision=precision, **COMMON), None, _images())
        assert seen == [during]
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
    train_epoch = ddp_train._train_epoch

    def spy(net, loader, optimizer, policy, scaler, device):
        seen.append((policy.dtype, scaler.is_enabled()))
        return train_epoch(net, loader, optimizer, policy, scaler, device)

    monkeypatch.setattr(ddp_train, "_train_epoch", spy)
    # One batch of 32: enough to run the autocast path (fp16 is slow on a CPU).
    result = train_ddp(DDPConfig(epochs=1, precision=precision, **COMMON), None, _images(32, 8))
    assert seen == [(dtype, precision == "fp16")]
    assert math.isfinite(result.train_loss[0])


# --- training that goes wrong -------------------------------------------------------------


def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_snapshot(tmp_path, monkeypatch):
    snapshot = tmp_path / "snap.pt"
    good = _images()
    train_ddp(DDPConfig(epochs=1, snapshot=str(snapshot), **COMMON), None, good)
    # NaN in the data is named as such, before training: not "diverged".
    poisoned = (good[0].float(), *good[1:])
    poisoned[0][5, 0, 3, 3] = math.nan
    with pytest.raises(ValueError, match=r"train images hold nan or inf"):
        train_ddp(DDPConfig(epochs=2, snapshot=str(snapshot), **COMMON), None, poisoned)
    # A loss that stops being finite (a diverging run) stops training at that epoch.
    class InfiniteLoss(torch.nn.CrossEntropyLoss):
        def forward(self, logits, target):
            return super().forward(logits, target) * math.inf

    monkeypatch.setattr(ddp_train.nn, "CrossEntropyLoss", InfiniteLoss)
    with pytest.raises(FloatingPointError, match=r"became (nan|inf) in epoch 2 \(steps 3-4\)"):
        train_ddp(DDPConfig(epochs=2, snapshot=str(snapshot), **COMMON), None, good)
    assert read_snapshot(snapshot)["epochs_done"] == 1


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
        train_ddp(DDPConfig(epochs=2, **COMMON), None, _images())


@pytest.mark.parametrize("which", ["train", "test"])
def test_an_empty_data_set_is_refused_before_training(which):
    x_train, y_train, x_test, y_test = _images()
    if which == "train":
        x_train, y_train = x_train[:0], y_train[:0]
    else:
        x_test, y_test = x_test[:0], y_test[:0]
    with pytest.raises(ValueError, match=rf"the {which} set is empty \(0 {which} images\)"):
        train_ddp(DDPConfig(epochs=1, **COMMON), None, (x_train, y_train, x_test, y_test))


# --- snapshots ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def _trained_once(tmp_path_factory):
    path = tmp_path_factory.mktemp("trained") / "snap.pt"
    train_ddp(DDPConfig(epochs=1, snapshot=str(path), **COMMON), None, _images())
    return path


@pytest.fixture
def one_epoch_snapshot(_trained_once, tmp_path):
    """A fresh copy, per test, of a snapshot after one epoch (trained once per module)."""
    path = tmp_path / "snap.pt"
    shutil.copy(_trained_once, path)
    return path


def test_resuming_with_other_settings_is_refused_naming_each(one_epoch_snapshot):
    path = one_epoch_snapshot
    written = path.read_bytes()
    changed = {**COMMON, "lr": 0.05, "batch_size": 16, "seed": 3, "quick": False,
               "precision": "bf16"}
    with pytest.raises(ValueError) as info:
        train_ddp(DDPConfig(epochs=2, snapshot=str(path), **changed), None, _images())
    message = str(info.value)
    assert str(path) in message
    assert "--lr 0.1 in the snapshot, 0.05 now" in message
    assert "--batch-size 32 in the snapshot, 16 now" in message
    assert "--seed 0 in the snapshot, 3 now" in message
    assert "--quick in the snapshot, --full now" in message
    assert "--precision fp32 in the snapshot, bf16 now" in message
    assert "--model" not in message  # only the settings that differ
    assert "another --snapshot path" in message and "delete" in message
    assert path.read_bytes() == written  # the refused run did not touch it


def test_fewer_epochs_than_the_snapshot_holds_is_refused(one_epoch_snapshot):
    path = one_epoch_snapshot
    train_ddp(DDPConfig(epochs=2, snapshot=str(path), **COMMON), None, _images())
    with pytest.raises(ValueError, match=r"already holds 2 epochs, more than --epochs 1"):
        train_ddp(DDPConfig(epochs=1, snapshot=str(path), **COMMON), None, _images())


def test_as_many_epochs_as_the_snapshot_holds_trains_nothing_and_says_so(
    one_epoch_snapshot, capsys
):
    path = one_epoch_snapshot
    result = train_ddp(
        DDPConfig(epochs=1, snapshot=str(path), **{**COMMON, "log": True}), None, _images()
    )
    out = capsys.readouterr().out
    assert f"{path} already holds all 1 epochs: nothing left to train" in out, out
    assert result.resumed_from_epoch == 1 and result.num_epochs == 1
    assert "epoch 1/1" not in out  # no epoch was trained
    # A DDP result is a History: the epoch it did not train came back from the snapshot.
    assert isinstance(result, History) and result.device == "cpu"
    assert result.summary().endswith("examples/sec on cpu"), result.summary()


def _garbage(path):
    path.write_bytes(b"this is not a snapshot\x00\x01")


def _empty(path):
    path.write_bytes(b"")


def _wrong_dict(path):
    # Checksummed, but everything except the settings it was written with.
    ddp_train._save_snapshot(path, {"model": {}, "optimizer": {}, "epochs_done": 1, "history": {}})


def _unchecked(path):
    # A plain torch.save of the right keys: an older format, or another program's file.
    torch.save({"model": {}, "optimizer": {}, "epochs_done": 1, "history": {}, "config": {}}, path)


def _directory(path):
    path.mkdir()


@pytest.mark.parametrize(
    "make, what",
    [
        (_garbage, "cannot read"),
        (_empty, "is empty"),
        (_wrong_dict, "lacks 'config'"),
        (_unchecked, "not a checksummed snapshot"),
        (_directory, "is a directory"),
    ],
)
def test_unusable_snapshots_name_the_file_the_problem_and_the_way_out(tmp_path, make, what):
    path = tmp_path / "snap.pt"
    make(path)
    with pytest.raises(ValueError) as info:
        train_ddp(DDPConfig(epochs=1, snapshot=str(path), **COMMON), None, _images())
    message = str(info.value)
    assert str(path) in message and what in message, message
    assert "--snapshot" in message, message


def test_snapshot_errors_on_the_command_line_print_the_message_and_exit_1(tmp_path, capsys):
    path = tmp_path / "snap.pt"
    _garbage(path)
    status = ddp_train.command_line(["--snapshot", str(path), "--data-root", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1
    assert f"error: cannot read snapshot {path}" in err and "Traceback" not in err, err


def test_a_snapshot_with_flipped_bytes_is_refused_naming_the_file(one_epoch_snapshot):
    path = one_epoch_snapshot
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 64] = bytes(b ^ 0xFF for b in raw[middle : middle + 64])
    path.write_bytes(bytes(raw))
    with pytest.raises(SnapshotError) as info:
        train_ddp(DDPConfig(epochs=2, snapshot=str(path), **COMMON), None, _images())
    message = str(info.value)
    assert str(path) in message and ("damaged" in message or "cannot read" in message), message
    assert "to start fresh" in message, message


@pytest.mark.parametrize("where", ["under_a_file", "under_proc"])
def test_an_unwritable_snapshot_path_fails_before_training(where, tmp_path, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking the snapshot path")

    monkeypatch.setattr(ddp_train, "build_model", no_training)
    if where == "under_a_file":
        (tmp_path / "file").write_text("x")
        path, what = tmp_path / "file" / "snap.pt", "is a regular file, not a directory"
    else:
        path, what = "/proc/d2lgpu/snap.pt", "cannot write snapshot"
    with pytest.raises(SnapshotError, match=what) as info:
        train_ddp(DDPConfig(epochs=1, snapshot=str(path), **COMMON), None, _images())
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "change, name",
    [({"snapshot": 3}, "snapshot"), ({"data_root": 1.5}, "data_root"), ({"log": "no"}, "log")],
)
def test_settings_of_the_wrong_type_are_refused_by_name(change, name):
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        DDPConfig(**{**COMMON, **change})


def test_train_ddp_refuses_data_that_is_not_four_tensors():
    with pytest.raises(TypeError, match="data must be a tuple of 4 tensors"):
        train_ddp(DDPConfig(**COMMON), None, [1, 2])
