"""Checks for the exercises at the end of every chapter: ``check.bubble_fraction(fn)`` calls
the learner's function on small inputs and compares it with the chapter's reference; an
unchanged stub raises :class:`ExerciseNotDone`, a wrong answer :class:`ExerciseWrong`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "ExerciseCheckFailed", "ExerciseNotDone", "ExerciseWrong", "attempt", "expect", "expect_close",
    "expect_tensor_close", "expect_value_error", "passed", "refuse_stub_early",
]


class ExerciseCheckFailed(AssertionError):
    """A check cell found the exercise unfinished or wrong; the message says what to do."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the traceback, whose frames would hide the message.
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class ExerciseNotDone(ExerciseCheckFailed):
    """The stub is unchanged: it still raises ``NotImplementedError``."""


class ExerciseWrong(ExerciseCheckFailed):
    """The learner's code ran but gave a wrong result."""


def _name(fn: object) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def attempt(exercise: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the learner's ``fn(*args, **kwargs)`` for exercise ``exercise`` ("9.2"): a stub
    becomes :class:`ExerciseNotDone`, and a forgotten ``return`` is named."""
    if not callable(fn):
        raise ExerciseWrong(f"Exercise {exercise}: the check takes your function itself, got a "
                            f"{type(fn).__name__}; pass the name without calling it, e.g. "
                            "check.x(my_function).")
    try:
        result = fn(*args, **kwargs)
    except NotImplementedError:
        raise ExerciseNotDone(f"Exercise {exercise} is not done yet: `{_name(fn)}` still raises "
                              "NotImplementedError. Write its body in the cell above, run that "
                              "cell, then run this check again.") from None
    if result is None:
        raise ExerciseWrong(f"Exercise {exercise}: `{_name(fn)}` returned None; does it end with "
                            "`return`?")
    return result


def expect(exercise: str, condition: bool, message: str) -> None:
    """Raise :class:`ExerciseWrong` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ExerciseWrong(f"Exercise {exercise}: {message}")


def expect_close(exercise: str, got: float, want: float, what: str,
                 rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> None:
    """Raise :class:`ExerciseWrong` unless the number ``got`` is close to ``want``."""
    if hasattr(got, "item") and getattr(got, "ndim", 0) == 0:
        got = got.item()  # a 0-d tensor or NumPy scalar
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        raise ExerciseWrong(f"Exercise {exercise}: {what} should be a number, got {got!r}")
    value = float(got)
    expect(exercise, math.isclose(value, want, rel_tol=rel_tol, abs_tol=abs_tol),
           f"{what} is {value:.6g}, expected {want:.6g}")


def expect_tensor_close(exercise: str, got: Any, want: torch.Tensor, what: str, atol: float,
                        hint: str) -> None:
    """``got`` must be a tensor of ``want``'s shape within ``atol`` of it; ``what`` names the
    case ("with n=4 ranks"), ``hint`` where to look."""
    shape = getattr(got, "shape", type(got).__name__)
    expect(exercise, isinstance(got, torch.Tensor) and got.shape == want.shape,
           f"{what}: expected a tensor of shape {tuple(want.shape)}, got {shape}")
    err = (got - want).abs().max().item()
    expect(exercise, err < atol, f"{what}: the result differs by up to {err:.3g}; {hint}")


def passed(exercise: str, what: str) -> None:
    """Print the line a passing check ends with."""
    print(f"Exercise {exercise} passed: {what}")


def expect_value_error(exercise: str, fn: Callable[..., Any], args: tuple, why: str,
                       kwargs: Mapping[str, Any] | None = None) -> None:
    """The learner's ``fn(*args, **kwargs)`` must refuse its arguments with a ValueError;
    ``why`` says what is wrong with them, and another exception is named."""
    try:
        attempt(exercise, fn, *args, **dict(kwargs or {}))
    except ExerciseCheckFailed:
        raise
    except ValueError:
        return
    except Exception as err:
        raise ExerciseWrong(f"Exercise {exercise}: {why}, and your function raised "
                            f"{type(err).__name__}: {err}; raise a ValueError that says "
                            "so instead") from None
    raise ExerciseWrong(f"Exercise {exercise}: {why}; raise a ValueError that says so")


class _StandIn:
    """An argument that stops any function that uses it (see :func:`refuse_stub_early`)."""

    def _touched(self, *args: object, **kwargs: object) -> object:
        raise LookupError("a stand-in was used: the function is no longer the stub")

    __getattr__ = __call__ = __iter__ = __len__ = __getitem__ = _touched


def refuse_stub_early(exercise: str, fn: Callable[..., Any], nargs: int) -> None:
    """Refuse an unchanged stub before a check builds anything costly (a first optimizer
    imports torch's compiler stack): ``fn`` runs on ``nargs`` stand-ins, where a stub raises
    ``NotImplementedError`` and a real solution stops at the first stand-in it uses."""
    try:
        attempt(exercise, fn, *[_StandIn() for _ in range(nargs)])
    except ExerciseNotDone:
        raise
    except ExerciseWrong:
        if not callable(fn):
            raise
    except Exception:  # the function used a stand-in: the real check follows
        pass
