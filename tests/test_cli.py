"""The flags the torchrun entry points share (d2lgpu.runtime.cli): their defaults, and the
usage errors (exit status 2) that name the flag and the rule."""

from __future__ import annotations

import argparse

import pytest

from d2lgpu.runtime.cli import add_job_flags, add_training_flags, check_checkpoint_flags

PRECISIONS = ("auto", "fp32", "bf16")


def _parser(**training) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainer")
    add_training_flags(parser, batch_size=16, lr=0.05, precisions=PRECISIONS, precision="fp32",
                       **training)
    add_job_flags(parser, crash_point="this epoch")
    return parser


def test_each_trainer_gets_its_own_defaults_and_only_the_flags_it_has():
    args = _parser(epochs=3, seed=0).parse_args([])
    assert (args.epochs, args.batch_size, args.lr, args.seed) == (3, 16, 0.05, 0)
    assert (args.precision, args.checkpoint_dir, args.quick) == ("fp32", None, None)
    assert args.timeout == 300.0 and args.fail_after_epoch is None
    bare = _parser().parse_args([])
    assert not hasattr(bare, "epochs") and not hasattr(bare, "seed")  # a trainer of steps
    only_timeout = argparse.ArgumentParser()
    add_job_flags(only_timeout, data=False, timeout_s=60.0)
    assert vars(only_timeout.parse_args([])) == {"timeout": 60.0}


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--epochs", "0"], "argument --epochs: must be a positive int"),
        (["--lr", "fast"], "argument --lr: must be a number, got 'fast'"),
        (["--seed", "-1"], "argument --seed: "),
        (["--timeout", "inf"], "argument --timeout: must be a positive finite number"),
        (["--precision", "half"], "argument --precision: invalid choice"),
        (["--quick", "--full"], "not allowed with argument --quick"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(argv, said, capsys):
    with pytest.raises(SystemExit) as info:
        _parser(epochs=3, seed=0).parse_args(argv)
    assert info.value.code == 2
    assert said in capsys.readouterr().err


def test_checkpoint_flags_are_checked_before_any_work(tmp_path, capsys):
    parser = _parser()
    with pytest.raises(SystemExit):
        check_checkpoint_flags(parser, parser.parse_args(["--fail-after-epoch", "1"]))
    assert "--fail-after-epoch needs --checkpoint-dir" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        check_checkpoint_flags(parser, parser.parse_args(["--checkpoint-dir",
                                                          str(tmp_path / "file" / "ckpt")]))
    assert "argument --checkpoint-dir: cannot write checkpoints" in capsys.readouterr().err
    root = tmp_path / "ckpt"
    check_checkpoint_flags(parser, parser.parse_args(["--checkpoint-dir", str(root)]))
    assert root.is_dir()  # created, ready for the first checkpoint


@pytest.mark.parametrize("fail, epochs, refused", [(1, 2, False), (2, 2, True), (3, 2, True),
                                                  (1, 1, True)])
def test_a_crash_must_come_before_the_last_epoch(fail, epochs, refused, tmp_path, capsys):
    parser = _parser(epochs=epochs)
    args = parser.parse_args(["--fail-after-epoch", str(fail), "--checkpoint-dir",
                              str(tmp_path / "ckpt"), "--epochs", str(epochs)])
    if not refused:
        check_checkpoint_flags(parser, args, epochs)
        return
    with pytest.raises(SystemExit) as info:
        check_checkpoint_flags(parser, args, epochs)
    assert info.value.code == 2
    assert f"--fail-after-epoch {fail} is not before the run's last epoch ({epochs})" in (
        capsys.readouterr().err)
