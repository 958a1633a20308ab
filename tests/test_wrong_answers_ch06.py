"""Chapter 6's exercise checks fail on plausible wrong answers, not only on the stubs.

Each wrong answer below is a slip a learner makes: an off-by-one in the significand bits,
the wrong side of a rounding tie, clipping before unscaling, counting the parameters as saved
activations. Every check must reject it with ``ExerciseWrong`` (and pass the right answer,
which the solutions notebook runs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from d2lgpu.exercises import ExerciseWrong
from d2lgpu.exercises import ch06 as check

# ---------------------------------------------------------------------------
# 6.1 largest_exact_integer
# ---------------------------------------------------------------------------


def _exact_up_to(dtype: torch.dtype) -> int:
    if not dtype.is_floating_point:
        raise ValueError(f"{dtype} is not a floating-point type")
    return int(2 / torch.finfo(dtype).eps)


def _stored_bits_only(dtype: torch.dtype) -> int:
    # Forgets the implicit leading 1: 2**(stored mantissa bits), half the right answer.
    if not dtype.is_floating_point:
        raise ValueError(f"{dtype} is not a floating-point type")
    return int(1 / torch.finfo(dtype).eps)


def _first_missing(dtype: torch.dtype) -> int:
    # The first integer that is not exact, one too many.
    return _exact_up_to(dtype) + 1


def _no_value_error(dtype: torch.dtype) -> int:
    # Right for floats, but answers for an integer dtype instead of refusing it.
    if not dtype.is_floating_point:
        return torch.iinfo(dtype).max
    return _exact_up_to(dtype)


def test_largest_exact_integer_passes_the_right_answer():
    check.largest_exact_integer(_exact_up_to)


@pytest.mark.parametrize("wrong", [_stored_bits_only, _first_missing, _no_value_error])
def test_largest_exact_integer_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.largest_exact_integer(wrong)


# ---------------------------------------------------------------------------
# 6.2 safe_scale_exponents
# ---------------------------------------------------------------------------


def _scales(gradients: torch.Tensor, floor: float = 2.0**-25, ceiling: float = 65520,
            floor_inclusive: bool = False, ceiling_inclusive: bool = False) -> tuple[int, int]:
    magnitudes = gradients.detach().double().abs().flatten()
    magnitudes = magnitudes[magnitudes > 0]
    if magnitudes.numel() == 0:
        raise ValueError("no nonzero gradient")
    smallest, largest = magnitudes.min().item(), magnitudes.max().item()
    lo = next(k for k in range(-200, 200)
              if (smallest * 2.0**k >= floor if floor_inclusive else smallest * 2.0**k > floor))
    hi = next(k for k in range(200, -200, -1)
              if (largest * 2.0**k <= ceiling if ceiling_inclusive else largest * 2.0**k < ceiling))
    if lo > hi:
        raise ValueError("too far apart")
    return lo, hi


def test_safe_scale_exponents_passes_the_right_answer():
    check.safe_scale_exponents(_scales)


@pytest.mark.parametrize("wrong", [
    # The tie at half the smallest subnormal rounds to 0 (ties to even), not up.
    lambda g: _scales(g, floor_inclusive=True),
    # Overflow starts at 65520 (the tie with 65536), not above fp16's largest number 65504.
    lambda g: _scales(g, ceiling=65504),
    # The smallest normal number instead of the smallest subnormal's half.
    lambda g: _scales(g, floor=2.0**-14),
    # No ValueError where no scale fits: returns an empty range instead.
    lambda g: (_scales(g) if g.abs().max() < 1e2 else (5, 4)),
])
def test_safe_scale_exponents_rejects_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.safe_scale_exponents(wrong)


# ---------------------------------------------------------------------------
# 6.3 amp_step
# ---------------------------------------------------------------------------


def _amp_step(net, optimizer, scaler, features, classes, dtype, max_norm, slip=None):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type="cpu", dtype=dtype):
        loss = F.cross_entropy(net(features), classes)
    scaler.scale(loss).backward()
    if slip == "clip scaled":
        nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    scaler.unscale_(optimizer)
    if slip not in ("clip scaled", "no clip"):
        nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    if slip == "plain step":
        optimizer.step()  # ignores the overflow the scaler found
    else:
        scaler.step(optimizer)
    if slip != "no update":
        scaler.update()
    return loss.item()


def test_amp_step_passes_the_right_answer():
    check.amp_step(_amp_step)


@pytest.mark.parametrize("slip", ["clip scaled", "no clip", "plain step", "no update"])
def test_amp_step_rejects_wrong_answers(slip):
    def wrong(*args):
        return _amp_step(*args, slip=slip)

    with pytest.raises(ExerciseWrong):
        check.amp_step(wrong)


# ---------------------------------------------------------------------------
# 6.4 saved_bytes_by_dtype
# ---------------------------------------------------------------------------


def _by_dtype(model, features, labels, dtype, slip=None):
    parameters = set() if slip == "with parameters" else {
        p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}
    per_tensor = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = (tensor.dtype, storage.nbytes())
            per_tensor.append((tensor.dtype, storage.nbytes()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(features), labels)
    del loss
    entries = per_tensor if slip == "every saved tensor" else list(saved.values())
    by_dtype = {}
    for kind, nbytes in entries:
        if slip == "all as the autocast dtype":
            kind = dtype or torch.float32
        by_dtype[kind] = by_dtype.get(kind, 0) + nbytes
    return by_dtype


def test_saved_bytes_by_dtype_passes_the_right_answer():
    check.saved_bytes_by_dtype(_by_dtype)


@pytest.mark.parametrize("slip", ["with parameters", "every saved tensor",
                                  "all as the autocast dtype"])
def test_saved_bytes_by_dtype_rejects_wrong_answers(slip):
    def wrong(model, features, labels, dtype):
        return _by_dtype(model, features, labels, dtype, slip=slip)

    with pytest.raises(ExerciseWrong):
        check.saved_bytes_by_dtype(wrong)
