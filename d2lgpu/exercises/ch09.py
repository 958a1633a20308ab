"""Checks for chapter 9's exercises (model parallelism)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from d2lgpu.exercises import (
    attempt,
    expect,
    expect_close,
    expect_tensor_close,
    expect_value_error,
    passed,
)
from d2lgpu.model_parallel import bubble_formula
from d2lgpu.models import MLPBlock


def interleaved_bubble(fn: Callable[[int, int, int], float]) -> None:
    """Exercise 9.1: ``fn(p, m, v)`` is the idle fraction with ``v`` stages per rank."""
    ex = "9.1"
    for p, m in ((2, 1), (2, 4), (4, 4), (4, 16), (8, 32)):
        for v in (1, 2):  # v stages of equal cost per rank: v times as many, shorter, pieces
            expect_close(ex, attempt(ex, fn, p, m, v), bubble_formula(p, v * m),
                         f"interleaved_bubble(p={p}, m={m}, v={v})")
    expect_close(ex, attempt(ex, fn, 1, 4, 1), 0.0,
                 "interleaved_bubble(p=1, m=4, v=1), one stage alone,")
    passed(ex, "4 stages and 4 microbatches leave 3/7 = 43% of the step idle; two stages "
               "per rank, 3/11 = 27%")


def split_into_stages(fn: Callable[[nn.Sequential, int], list[nn.Sequential]]) -> None:
    """Exercise 9.2: ``fn(model, p)`` splits any depth into ``p`` stages, the first ones longer."""
    ex = "9.2"
    for depth, p in ((8, 2), (6, 3), (7, 3), (5, 4), (3, 3)):
        model = nn.Sequential(*[MLPBlock(8, 16) for _ in range(depth)])
        stages = attempt(ex, fn, model, p)
        expect(ex, isinstance(stages, (list, tuple)),
               f"return a list of stages, got {type(stages).__name__}")
        sizes = [len(stage) for stage in stages]
        want = [depth // p + (1 if s < depth % p else 0) for s in range(p)]
        expect(ex, sizes == want,
               f"{depth} blocks into {p} stages gave stage sizes {sizes}; sizes differ by at "
               f"most one, the longer stages first: {want}")
        modules = [block for stage in stages for block in stage]
        expect(ex, all(a is b for a, b in zip(modules, model, strict=True)),
               "the stages must hold the model's own blocks, in order (no copies): "
               "slice the nn.Sequential, model[i:j]")
        x = torch.randn(4, 8)
        expect(ex, torch.allclose(nn.Sequential(*stages)(x), model(x)),
               "running the stages one after the other does not give the model's output")
    two = nn.Sequential(MLPBlock(8, 16), MLPBlock(8, 16))
    expect_value_error(ex, fn, (two, 3), "2 blocks into 3 stages leave a stage empty")
    passed(ex, "7 blocks on 3 ranks run as stages of 3, 2 and 2 blocks, and give the "
               "model's output")


class _MatmulShapes(TorchDispatchMode):
    """The operand shapes of every matrix multiply under it."""

    _MATMULS = ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "_addmm_activation")

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[list[tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func.overloadpacket.__name__ in self._MATMULS:
            self.shapes.append([tuple(a.shape) for a in args if isinstance(a, torch.Tensor)])
        return func(*args, **(kwargs or {}))


def tensor_parallel_mlp(fn: Callable[[MLPBlock, torch.Tensor, int], torch.Tensor]) -> None:
    """Exercise 9.3: ``fn(block, x, n)`` computes ``block(x)`` as ``n`` tensor-parallel ranks,
    no matrix multiply using all the hidden units at once."""
    ex = "9.3"
    torch.manual_seed(0)
    width, hidden = 16, 64
    block = MLPBlock(width, hidden)
    x = torch.randn(3, 5, width)
    with torch.no_grad():
        want = block(x)
        for n in (1, 2, 4, 8):
            watch = _MatmulShapes()
            with watch:
                got = attempt(ex, fn, block, x, n)
            expect_tensor_close(ex, got, want, f"with n={n} ranks, against block(x)", 1e-5,
                                "each rank takes its rows of fc1.weight and fc1.bias and the same "
                                "columns of fc2.weight; the partial outputs are summed, and "
                                "fc2's bias and the residual added once")
            if n == 1:
                continue
            expect(ex, bool(watch.shapes),
                   f"with n={n} ranks no matrix multiply ran: compute each rank's share with "
                   "its slices of the weights (x @ w.T or F.linear)")
            whole = [s for s in watch.shapes if any(hidden in shape for shape in s)]
            expect(ex, not whole,
                   f"with n={n} ranks a matrix multiply used all {hidden} hidden units at once "
                   f"(operands of shapes {whole[0] if whole else ''}): each rank multiplies by "
                   f"its own {hidden}/{n} only, and the partial outputs are summed")
    with torch.no_grad():
        expect_value_error(ex, fn, (block, x, 3), "64 hidden units do not split over 3 ranks")
    passed(ex, "fc1 split column-wise (its output features) and fc2 row-wise (its input "
               "features) over 1, 2, 4 and 8 ranks, no rank multiplying by all the hidden "
               "units, one sum at the end: the block's output")


def activations_held(fn: Callable[[str, int, int, int], int]) -> None:
    """Exercise 9.4: ``fn(schedule, p, m, stage)``, microbatches of activations a stage keeps."""
    ex = "9.4"
    for p, m in ((2, 4), (4, 4), (4, 16), (4, 2)):
        for stage in range(p):
            got = attempt(ex, fn, "gpipe", p, m, stage)
            expect(ex, got == m, f"GPipe, p={p}, m={m}, stage {stage}: {got}, expected {m}")
            want = min(m, p - stage)
            got = attempt(ex, fn, "1f1b", p, m, stage)
            expect(ex, got == want,
                   f"1F1B, p={p}, m={m}, stage {stage}: {got}, expected {want} (the chapter "
                   "measured it: stage s starts p - s forwards before its first backward)")
    expect_value_error(ex, fn, ("zigzag", 2, 4, 0),
                       "'zigzag' is no schedule: name the known ones, 'gpipe' and '1f1b'")
    passed(ex, "with m = 16 and p = 4, 1F1B's first stage keeps 4 microbatches, GPipe's 16")
