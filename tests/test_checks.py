import math
import os
from pathlib import Path

import pytest
import torch

from d2lgpu.runtime.checks import (
    DIVERGENCE_FACTOR,
    check_batch,
    check_bool,
    check_finite_tensors,
    check_loader,
    check_positive_float,
    check_positive_int,
    check_seed,
    check_tensor,
    check_training_loss,
    check_writable_path,
    error_line,
    find_non_finite_batch,
    loss_diverged,
)


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_positive_ints_pass_through(value):
    assert check_positive_int("n", value) == value


@pytest.mark.parametrize("value", [0, -3, 1.0, "2", None, True])
def test_everything_else_is_refused_with_the_name(value):
    with pytest.raises(ValueError, match=r"^batch_size must be a positive int, got "):
        check_positive_int("batch_size", value)


@pytest.mark.parametrize("value", [0, 5, 2**64 - 1])
def test_seeds_torch_takes_pass_through(value):
    assert check_seed(value) == value


@pytest.mark.parametrize("value", [-1, 2**64, 1.0, "3", True])
def test_other_seeds_are_refused_with_the_range(value):
    with pytest.raises(ValueError, match=r"seed must be an int from 0 to 2\*\*64 - 1"):
        check_seed(value)


@pytest.mark.parametrize("value", [1, 0.5, 1e-12, 300.0])
def test_positive_finite_numbers_pass_as_floats(value):
    result = check_positive_float("lr", value)
    assert result == value and isinstance(result, float)


@pytest.mark.parametrize("value", [0, -0.1, math.nan, math.inf, -math.inf, "0.1", None, True])
def test_everything_else_is_refused_as_a_positive_finite_number(value):
    with pytest.raises(ValueError, match=r"^lr must be a positive finite number, got "):
        check_positive_float("lr", value)


# --------------------------------------------------------------------------- #
# The checks written once per kind of input
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("value", ["no", "false", 1, 0, None, 1.0])
def test_booleans_are_real_booleans(value):
    with pytest.raises(TypeError, match=r"^shuffle must be True or False, got "):
        check_bool("shuffle", value)


def test_tensors_are_checked_for_type_and_dtype():
    with pytest.raises(TypeError, match=r"X must be a torch.Tensor, got None: pass a tensor"):
        check_tensor("X", None)
    with pytest.raises(TypeError, match=r"X must be a floating-point tensor, got torch.int64"):
        check_tensor("X", torch.zeros(3, dtype=torch.int64), dtype="floating")
    assert check_tensor("y", torch.zeros(3, dtype=torch.int64)) is not None


def test_finite_tensors_count_nan_and_inf():
    bad = torch.tensor([1.0, math.nan, math.inf, math.nan])
    with pytest.raises(ValueError, match=r"^X hold 2 NaN and 1 inf value"):
        check_finite_tensors("X", [bad])
    check_finite_tensors("ints", [torch.arange(3)])  # integers hold neither


def test_loaders_and_batches():
    for value in (None, "data", torch.zeros(4), 3):
        with pytest.raises(TypeError, match=r"^train_iter must yield batches \(X, y\), got"):
            check_loader("train_iter", value)
    with pytest.raises(ValueError, match=r"train_iter is empty \(length 0\)"):
        check_loader("train_iter", [])
    X, y = torch.zeros(2, 3), torch.zeros(2)
    assert check_batch("train_iter", (X, y), 0)[0] is X
    with pytest.raises(TypeError, match=r"batch 4 of train_iter is Tensor"):
        check_batch("train_iter", X, 4)
    with pytest.raises(TypeError, match=r"batch 0 of train_iter is tuple \(\[1, 2\], tensor"):
        check_batch("train_iter", ([1, 2], y), 0)
    with pytest.raises(ValueError, match=r"X of shape \(2, 3\) and y of shape \(3,\)"):
        check_batch("train_iter", (X, torch.zeros(3)), 0)
    broken = torch.ones(2, 3)
    broken[1, 2] = math.nan
    assert find_non_finite_batch("train_iter", [(X, y), (X, y)]) is None
    assert find_non_finite_batch("train_iter", [(X, y), (broken, y)]).startswith(
        "batch 1 of train_iter holds 1 NaN and 0 inf"
    )


def test_the_shared_loss_check_stops_nan_inf_and_blow_ups():
    check_training_loss(2.3, when="step 1", lr=0.1, first_loss=2.3)
    check_training_loss(2.3 * DIVERGENCE_FACTOR * 0.99, when="step 9", lr=0.1, first_loss=2.3)
    for loss in (math.nan, math.inf):
        with pytest.raises(FloatingPointError, match=rf"loss became {loss} in step 3.*0\.5"):
            check_training_loss(loss, when="step 3", lr=0.5)
    with pytest.raises(FloatingPointError,
                       match=r"grew to 25.3, more than 10 times the 2.3 it started from, in "
                             r"step 4: training diverged at lr 3\. Try a smaller lr"):
        check_training_loss(2.3 * 11, when="step 4", lr=3.0, first_loss=2.3)


def test_the_divergence_rule_on_both_sides_of_its_line():
    assert DIVERGENCE_FACTOR == 10
    # Against the start, on both sides of ten times it.
    assert not loss_diverged(22.9, 2.3) and loss_diverged(23.1, 2.3)
    assert not loss_diverged(9.9e5, 1e5) and loss_diverged(1.01e6, 1e5)
    # A start below 1 is counted as 1: small losses that wander are not divergence.
    assert not loss_diverged(9.9, 0.01) and loss_diverged(10.1, 0.01)
    # Not finite is always divergence; with no start only finiteness is judged.
    assert loss_diverged(math.nan, None) and loss_diverged(-math.inf, 2.3)
    assert not loss_diverged(1e30, None) and not loss_diverged(5.0, math.nan)


def test_paths_that_cannot_be_written_are_refused_before_any_work(tmp_path):
    assert check_writable_path("snapshot", tmp_path / "new" / "s.pt") == tmp_path / "new" / "s.pt"
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"is a regular file, not a directory"):
        check_writable_path("snapshot", a_file / "sub" / "s.pt")
    with pytest.raises(ValueError, match=r"under /proc, a system file system"):
        check_writable_path("snapshot", "/proc/self/snapshot.pt")
    with pytest.raises(ValueError, match="is a directory: name a file"):
        check_writable_path("snapshot", tmp_path)
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_writable_path("checkpoint_dir", a_file, kind="directory")
    with pytest.raises(TypeError, match="must be a path"):
        check_writable_path("snapshot", None)
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="not writable"):
            check_writable_path("snapshot", locked / "s.pt")
    assert not Path(tmp_path / "new").exists()  # nothing was created


def test_an_error_as_one_line_keeps_its_type_and_first_line():
    assert error_line(RuntimeError("CUDA error: out of memory\nCompile with ...")) == (
        "RuntimeError: CUDA error: out of memory")
    assert error_line(ValueError()) == "ValueError: "
