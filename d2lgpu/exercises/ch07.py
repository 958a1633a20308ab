"""Checks for chapter 7's exercises (profiling, the roofline, torch.compile, CUDA graphs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from d2lgpu.chips import GPU_DATASHEETS, PEAK_TFLOPS
from d2lgpu.exercises import (
    ExerciseWrong,
    attempt,
    expect,
    expect_close,
    expect_tensor_close,
    expect_value_error,
    passed,
)
from d2lgpu.profiling import Roofline, explain_graph_breaks, profiler_activities


def _reads(k: int) -> Callable[[], float]:
    def read_k_numbers() -> float:  # k single numbers read back with .item()
        values = torch.arange(4.0)
        return sum(values[i % 4].item() for i in range(k))
    return read_k_numbers


def _two_relus() -> torch.Tensor:
    return torch.relu(torch.relu(torch.ones(3) - 2))


def count_calls(fn: Callable[[Callable[[], object], str], int]) -> None:
    """Exercise 7.1: ``fn(work, op)`` profiles one call of ``work()`` and counts ``op``."""
    ex = "7.1"
    profiler_activities(torch.device("cpu"))  # quiets the profiler engine's lines on a CPU
    cases = [(_reads(k), "aten::item", k, f"a function that calls .item() {k} times")
             for k in (0, 1, 3)]
    cases.append((_two_relus, "aten::relu", 2, "torch.relu(torch.relu(t))"))
    cases.append((_two_relus, "aten::item", 0, "torch.relu(torch.relu(t)), which reads nothing"))
    for work, op, want, what in cases:
        try:
            got = attempt(ex, fn, work, op)
        except StopIteration:
            raise ExerciseWrong(
                f"Exercise {ex}: for {what}, looking up {op!r} raised StopIteration: an op that "
                "never ran has no row in key_averages(); give next(...) a default of 0"
            ) from None
        expect(ex, isinstance(got, int) and not isinstance(got, bool),
               f"count_calls(..., {op!r}) should return an int (the `count` of the row of "
               f"key_averages() whose key is {op!r}), got {got!r}")
        hint = (" An op that never ran has no row in key_averages(): return 0 then."
                if want == 0 else
                " Profile only the call of work() (inside `with profile(...)`), and take the "
                "`count` of the row whose `key` equals op.")
        expect(ex, got == want, f"for {what}, {op} ran {want} time(s); you counted {got}.{hint}")
    passed(ex, "every .item() is one aten::item call in the table: on a GPU, one wait for "
               "the queue to drain")


def _centered_and_clipped(x: torch.Tensor) -> torch.Tensor:
    # The exercise's function, with its two graph breaks (the reference).
    positives = int((x > 0).sum())
    if positives > x.numel() // 2:
        x = x - x.mean()
    limit = x.abs().max().item()
    return x.clamp(-limit / 2, limit / 2)


def no_graph_break(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Exercise 7.4: ``fn(x)`` computes ``centered_and_clipped(x)`` with no graph break."""
    ex = "7.4"
    inputs = {
        "x = torch.linspace(-1, 3, 16) (most entries positive: centred)":
            torch.linspace(-1, 3, 16),
        "x = torch.linspace(-3, 1, 16) (most entries negative: not centred)":
            torch.linspace(-3, 1, 16),
        "x = torch.tensor([-2.0, 1.0, 3.0, -1.0]) (exactly half positive: not centred)":
            torch.tensor([-2.0, 1.0, 3.0, -1.0]),
        "a seeded 3x5 torch.randn": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
    }
    for what, x in inputs.items():
        got = attempt(ex, fn, x.clone())
        want = _centered_and_clipped(x.clone())
        expect_tensor_close(ex, got, want, f"for {what}, against centered_and_clipped(x)", 1e-6,
                            "keep the same arithmetic, only turn the Python numbers into "
                            "0-d tensors and the `if` into torch.where")
    torch._dynamo.reset()
    try:
        report = explain_graph_breaks(fn, torch.linspace(-1, 3, 16))
    finally:
        torch._dynamo.reset()
    expect(ex, report.break_count == 0,
           "dynamo still breaks the graph:\n" + report.describe() +
           "\nEach .item() or int()/float() of a tensor is a break: keep the values as tensors")
    passed(ex, "one graph, no break, the same results on both sides of the branch")


def roofline_time(fn: Callable[[float, float, Roofline], tuple[float, str]]) -> None:
    """Exercise 7.2: ``fn(flops, nbytes, roofline)``, the shortest time the roofline allows
    an operation, and which roof sets it."""
    ex = "7.2"
    peak, _ = PEAK_TFLOPS[("h100", "sxm5")]
    bandwidth = float(str(GPU_DATASHEETS["H100 SXM5"]["memory bandwidth"]).split()[0])
    rooflines = (Roofline(peak, bandwidth), Roofline(2.0, 50.0))
    n, d = 2**24, 4096
    operations = {
        "an fp32 add of 2^24 elements": (n, 12 * n),
        "a bf16 matmul of one token through a 4096x4096 weight": (
            2 * d * d, 2 * (d + d * d + d)),
        "a bf16 matmul of 8192 tokens through a 4096x4096 weight": (
            2 * 8192 * d * d, 2 * (8192 * d + d * d + 8192 * d)),
        "an operation that moves bytes and computes nothing": (0, 4096),
    }
    for roof in rooflines:
        for what, (flops, nbytes) in operations.items():
            got = attempt(ex, fn, flops, nbytes, roof)
            expect(ex, isinstance(got, tuple) and len(got) == 2,
                   f"return a pair (seconds, 'memory-bound' or 'compute-bound'), got {got!r}")
            seconds, bound = got
            intensity = flops / nbytes
            want = (nbytes / (roof.bandwidth_gbps * 1e9) if flops == 0
                    else flops / (roof.attainable_tflops(intensity) * 1e12))
            where = (f"for {what} on a roofline of {roof.peak_tflops:g} TFLOP/s and "
                     f"{roof.bandwidth_gbps:g} GB/s")
            expect_close(ex, seconds, want, f"the time {where}", rel_tol=1e-9, abs_tol=0.0)
            want_bound = "compute-bound" if intensity >= roof.ridge else "memory-bound"
            expect(ex, bound == want_bound,
                   f"{where}: {bound!r}, expected {want_bound!r} (intensity {intensity:.3g} "
                   f"FLOP/B, ridge {roof.ridge:.3g})")
    for flops, nbytes in ((-1.0, 8.0), (8.0, 0.0), (8.0, -4.0)):
        expect_value_error(ex, fn, (flops, nbytes, rooflines[0]),
                           f"{flops:g} FLOPs over {nbytes:g} bytes is not an operation")
    passed(ex, "on an H100 one token through a 4096x4096 layer waits for memory; 8192 tokens "
               "wait for the Tensor Cores")


def copy_into_static(fn: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]],
                                  Sequence[torch.Tensor]]) -> None:
    """Exercise 7.6: ``fn(static, batch)`` copies a batch into a graph's fixed input tensors."""
    ex = "7.6"
    gen = torch.Generator().manual_seed(0)
    static = (torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64))
    addresses = [t.data_ptr() for t in static]
    for step in range(2):
        batch = (torch.randn(4, 3, generator=gen), torch.randint(0, 10, (4,), generator=gen))
        got = attempt(ex, fn, static, batch)
        expect(ex, isinstance(got, (list, tuple)) and len(got) == len(static),
               f"return the static tensors (a tuple of {len(static)}), got {got!r}")
        expect(ex, all(a is b for a, b in zip(got, static, strict=True)),
               "return the static tensors themselves, not new ones: a recorded graph reads "
               "the tensors it was recorded with, and only those")
        expect(ex, [t.data_ptr() for t in static] == addresses,
               "a static tensor moved to new memory: write into it in place (tensor.copy_), "
               "never replace it")
        expect(ex, all(torch.equal(s, b) for s, b in zip(static, batch, strict=True)),
               f"after batch {step + 1} the static tensors do not hold the batch's values")
    bad_batches = {
        "the last batch of an epoch, with 2 examples instead of 4":
            (torch.randn(2, 3), torch.randint(0, 10, (2,))),
        "labels of dtype int32 where the recording used int64 (copy_ would convert silently)":
            (torch.randn(4, 3), torch.randint(0, 10, (4,), dtype=torch.int32)),
        "one tensor where the recording took two": (torch.randn(4, 3),),
    }
    for what, batch in bad_batches.items():
        before = [t.clone() for t in static]
        expect_value_error(ex, fn, (static, batch),
                           f"{what}: a replay would compute the wrong thing or read past the data")
        expect(ex, all(torch.equal(a, b) for a, b in zip(before, static, strict=True)),
               f"{what}: refuse before copying anything, so the static tensors stay as they were")
    passed(ex, "new batches go into the recorded tensors in place; other shapes, dtypes and "
               "counts are refused")
