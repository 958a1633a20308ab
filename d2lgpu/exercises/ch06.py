"""Checks for chapter 6's exercises (mixed precision), on the CPU, where autocast and
``GradScaler`` compute the same numbers on every machine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from d2lgpu.exercises import (
    ExerciseWrong,
    attempt,
    expect,
    expect_close,
    expect_value_error,
    passed,
    refuse_stub_early,
)
from d2lgpu.parallel import max_abs_difference
from d2lgpu.precision import sweep_cnn

_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2)


def _first_power_with_a_gap(dtype: torch.dtype) -> int:
    """The power of two m such that m + 1 is the first integer ``dtype`` cannot hold."""
    def exact(n: int) -> bool:
        return torch.tensor(float(n), dtype=torch.float64).to(dtype).double().item() == n

    return next(2**e for e in range(1, 64) if not exact(2**e + 1))


def largest_exact_integer(fn: Callable[[torch.dtype], int]) -> None:
    """Exercise 6.1: ``fn(dtype)``, the largest N with every integer 0..N exact in ``dtype``."""
    ex = "6.1"
    for dtype in _FLOAT_TYPES:
        want = _first_power_with_a_gap(dtype)
        got = attempt(ex, fn, dtype)
        expect(ex, isinstance(got, (int, float)) and not isinstance(got, bool),
               f"largest_exact_integer({dtype}) returned a {type(got).__name__}; return an int")
        if got != want:
            rounded = torch.tensor(float(want + 1), dtype=torch.float64).to(dtype).item()
            why = (f"{int(got) + 1} is exact in it as well" if got < want
                   else f"{want + 1} is not: it rounds to {rounded:g}")
            expect(ex, False, f"largest_exact_integer({dtype}) is {got}, expected {want} ({why}). "
                   "With p significant bits (the stored mantissa bits plus the implicit leading "
                   "1) every integer up to 2**p is exact, and 2**p + 1 is the first that is not")
    for dtype in (torch.int32, torch.bool):
        expect_value_error(ex, fn, (dtype,), f"{dtype} is not a floating-point type (every "
                           "integer in its range is exact, the question does not apply)")
    passed(ex, "fp16 counts exactly to 2048, bf16 only to 256, fp32 to 16,777,216")


def _safe_exponents(gradients: torch.Tensor) -> tuple[int, int] | None:
    """Brute force with torch's rounding: the k whose 2**k keeps every gradient alive in fp16."""
    values = gradients.detach().double().flatten()
    values = values[values != 0]
    if values.numel() == 0:
        return None
    ok = [k for k in range(-160, 161)
          if bool(((values * 2.0**k).to(torch.float16) != 0).all())
          and bool(torch.isfinite((values * 2.0**k).to(torch.float16)).all())]
    return (min(ok), max(ok)) if ok else None


def safe_scale_exponents(fn: Callable[[torch.Tensor], tuple[int, int]]) -> None:
    """Exercise 6.2: ``fn(gradients)``, the range of k for which a scale 2**k turns no nonzero
    gradient into 0 or inf in fp16; compared with a search through torch's own rounding."""
    ex = "6.2"
    logs = torch.empty(1000).uniform_(-9, -1, generator=torch.Generator().manual_seed(0))
    signs = torch.randint(0, 2, (1000,), generator=torch.Generator().manual_seed(1)) * 2 - 1
    cases = {
        "[1e-8, 3e-5, 0.02, 0.0, -0.5]": torch.tensor([1e-8, 3e-5, 0.02, 0.0, -0.5]),
        "[2**-30], a power of two": torch.tensor([2.0**-30]),
        "[1.5 * 2**-25], above half the smallest subnormal": torch.tensor([1.5 * 2.0**-25]),
        "[65520 * 2**-20], at the tie that rounds to inf": torch.tensor([65520 * 2.0**-20]),
        "[65510 * 2**-20], between fp16's largest and the tie": torch.tensor([65510 * 2.0**-20]),
        "[3.0, -1e-3, 7e-6]": torch.tensor([3.0, -1e-3, 7e-6]),
        "1000 gradients from 1e-9 to 0.1": signs * 10.0**logs,
    }
    for name, gradients in cases.items():
        want = _safe_exponents(gradients)
        assert want is not None
        got = attempt(ex, fn, gradients.clone())
        expect(ex, isinstance(got, (tuple, list)) and len(got) == 2,
               f"for {name}: return a tuple (smallest k, largest k), got {got!r}")
        got = (int(got[0]), int(got[1]))
        lo, hi = want
        scaled = gradients.double() * 2.0 ** got[0]
        note = ""
        if got[0] < lo:
            note = (f"; with 2**{got[0]} the smallest gradient becomes "
                    f"{(scaled[scaled != 0].abs().min()).item():.3g}, which fp16 rounds to 0 "
                    "(anything at or below half its smallest subnormal, 2**-25, becomes 0)")
        elif got[1] > hi:
            top = (gradients.double().abs().max() * 2.0 ** got[1]).item()
            note = (f"; with 2**{got[1]} the largest becomes {top:.6g}, which fp16 rounds to "
                    "inf (from 65520 up, the tie between 65504 and 65536, it overflows)")
        expect(ex, got == want,
               f"for {name}: you found k from {got[0]} to {got[1]}, torch's rounding allows "
               f"{lo} to {hi}{note}")
    for name, gradients in (("[1e-12, 1e3], too far apart for fp16", torch.tensor([1e-12, 1e3])),
                            ("all zeros, nothing to protect", torch.zeros(4))):
        expect_value_error(ex, fn, (gradients,), f"for {name}, no range of scales exists")
    lo, hi = _safe_exponents(cases["[1e-8, 3e-5, 0.02, 0.0, -0.5]"]) or (0, 0)
    passed(ex, f"gradients from 1e-8 to 0.5 fit fp16 under scales 2**{lo} to 2**{hi}; "
               "GradScaler starts at 2**16")


def _tiny_problem(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The chapter's tiny_problem: a small MLP and one fixed batch, on the CPU."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(32, 16, generator=generator)
    classes = torch.randint(0, 10, (32,), generator=generator)
    return net, features, classes


def _reference_step(net: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, features: torch.Tensor, classes: torch.Tensor,
                    dtype: torch.dtype, max_norm: float, variant: str = "recipe") -> float:
    """The chapter's step (autocast, scaled backward, unscale, clip, step, update), or with
    ``variant`` one of the two slips the check names: "no clip" and "clip scaled"."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type="cpu", dtype=dtype):
        loss = F.cross_entropy(net(features), classes)
    scaler.scale(loss).backward()
    if variant == "clip scaled":
        nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    scaler.unscale_(optimizer)
    if variant == "recipe":
        nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def _run_steps(step: Callable[..., object], dtype: torch.dtype, use_scaler: bool,
               input_scale: float, max_norm: float, steps: int, ex: str | None = None,
               variant: str = "recipe"
               ) -> tuple[list[list[torch.Tensor]], list[float], list[float]]:
    """Parameters, losses and scales after each of ``steps`` steps from the same start."""
    net, features, classes = _tiny_problem()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=use_scaler)
    params, losses, scales = [], [], []
    for _ in range(steps):
        args = (net, optimizer, scaler, features * input_scale, classes, dtype, max_norm)
        if not ex:
            loss = step(*args, variant=variant)
        else:
            try:
                loss = attempt(ex, step, *args)
            except RuntimeError as err:
                if "after step()" not in str(err):
                    raise
                raise ExerciseWrong(
                    f"Exercise {ex}: the scaler refused your second step ({err}): call "
                    "scaler.update() after scaler.step(optimizer) in every step, which resets "
                    "the scaler for the next one") from None
        params.append([p.detach().clone() for p in net.parameters()])
        losses.append(loss)
        scales.append(scaler.get_scale() if use_scaler else 1.0)
    return params, losses, scales


_SLIPS = {"the gradients were not clipped: clip_grad_norm_(net.parameters(), max_norm) after "
          "unscale_": "no clip",
          "the gradients were clipped while still scaled: call scaler.unscale_(optimizer) "
          "before clip_grad_norm_": "clip scaled"}


def amp_step(fn: Callable[..., float]) -> None:
    """Exercise 6.3: ``fn(net, optimizer, scaler, features, classes, dtype, max_norm)``, one
    step of the chapter's recipe with clipping: parameters, loss and scale after every step."""
    ex = "6.3"
    refuse_stub_early(ex, fn, 7)
    runs = (("fp16 + GradScaler, max_norm=0.25", torch.float16, True, 1.0, 0.25, 3),
            ("bf16, disabled scaler, max_norm=0.5", torch.bfloat16, False, 1.0, 0.5, 3),
            ("fp16 on inputs 1e4 times too large", torch.float16, True, 1e4, 0.25, 2))
    for label, dtype, use_scaler, input_scale, max_norm, steps in runs:
        want = _run_steps(_reference_step, dtype, use_scaler, input_scale, max_norm, steps)
        got = _run_steps(fn, dtype, use_scaler, input_scale, max_norm, steps, ex=ex)
        for s in range(steps):
            err = max_abs_difference(got[0][s], want[0][s])
            if not err <= 1e-6:  # NaN parameters count as different
                for message, variant in _SLIPS.items():
                    slipped = _run_steps(_reference_step, dtype, use_scaler, input_scale,
                                         max_norm, steps, variant=variant)
                    expect(ex, not max_abs_difference(got[0][s], slipped[0][s]) <= 1e-6,
                           f"{label}, step {s + 1}: {message}")
                if input_scale > 1:
                    expect(ex, False,
                           f"{label}, step {s + 1}: the parameters changed, but this step's "
                           "gradients overflowed; scaler.step(optimizer) skips such a step, "
                           "optimizer.step() does not")
                expect(ex, False,
                       f"{label}, step {s + 1}: the parameters differ from the recipe's by up "
                       f"to {err:.2e}. The recipe: zero the gradients; forward pass and loss "
                       "inside torch.autocast('cpu', dtype=dtype); scaler.scale(loss)"
                       ".backward(); scaler.unscale_(optimizer); clip_grad_norm_; "
                       "scaler.step(optimizer); scaler.update()")
            expect_close(ex, got[1][s], want[1][s], f"{label}, step {s + 1}: the loss returned "
                         "(loss.item() of the unscaled loss)", rel_tol=1e-5, abs_tol=1e-6)
            expect(ex, got[2][s] == want[2][s],
                   f"{label}: after step {s + 1} the scale is {got[2][s]:g}, the recipe's "
                   f"{want[2][s]:g}: call scaler.update() once after every step")
    passed(ex, "fp16 and bf16 steps equal the recipe's; on overflowing inputs the steps are "
               "skipped and the scale halves: 65536 -> 16384 in two steps")


def _reference_by_dtype(model: nn.Module, features: torch.Tensor, labels: torch.Tensor,
                        dtype: torch.dtype | None,
                        with_parameters: bool = False) -> dict[torch.dtype, int]:
    """The chapter's count_saved_bytes by dtype; ``with_parameters`` is the slip the check
    names."""
    parameters = set() if with_parameters else {
        p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[torch.dtype, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = (tensor.dtype, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(features), labels)
    del loss
    by_dtype: dict[torch.dtype, int] = {}
    for kind, nbytes in saved.values():
        by_dtype[kind] = by_dtype.get(kind, 0) + nbytes
    return by_dtype


@contextlib.contextmanager
def _eval_free(model: nn.Module) -> Iterator[None]:
    """Keep batch norm's running statistics as they were: the counts run several forwards."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        model.load_state_dict(state)


def _short(by_dtype: dict[torch.dtype, int]) -> dict[str, int]:
    return {str(k).replace("torch.", ""): v for k, v in by_dtype.items()}


def saved_bytes_by_dtype(fn: Callable[..., dict[torch.dtype, int]]) -> None:
    """Exercise 6.4: ``fn(model, features, labels, dtype)``, saved bytes per dtype, against the
    chapter's counter by dtype on its tiny MLP and a small ``sweep_cnn``, fp32 and bf16."""
    ex = "6.4"
    torch.manual_seed(0)
    models = {"the tiny MLP": (_tiny_problem()[0], (16,)),
              "a small sweep_cnn": (sweep_cnn(widths=(4, 8)), (1, 8, 8))}
    names = {None: "fp32", torch.bfloat16: "bf16"}
    for model_name, (model, shape) in models.items():
        for batch in (8, 32):
            generator = torch.Generator().manual_seed(batch)
            features = torch.randn(batch, *shape, generator=generator)
            labels = torch.randint(0, 10, (batch,), generator=generator)
            for dtype, name in names.items():
                with _eval_free(model):
                    want = _reference_by_dtype(model, features, labels, dtype)
                    slip = _reference_by_dtype(model, features, labels, dtype, True)
                    got = attempt(ex, fn, model, features, labels, dtype)
                case = f"{model_name}, batch {batch}, {name}"
                expect(ex, isinstance(got, dict),
                       f"{case}: return a dict {{dtype: bytes}}, got {type(got).__name__}")
                got = {k: int(v) for k, v in got.items() if v}
                hint = ("leave out the storages of the model's parameters (they exist without "
                        "a graph)" if got == slip
                        else "count each storage once (key it by untyped_storage().data_ptr()), "
                             "leave out the parameters' storages, and file its bytes under the "
                             "saved tensor's dtype")
                expect(ex, got == want, f"{case}: got {_short(got)}, expected {_short(want)}: "
                       f"{hint}")
    passed(ex, "under bf16 autocast the activations and weight copies are saved in bf16; "
               "batch norm's statistics and the log-softmax output stay fp32, the labels and "
               "max pooling's indices int64")
