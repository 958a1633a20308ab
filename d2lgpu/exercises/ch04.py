"""Checks for chapter 4's exercises (several GPUs the concise way: nn.DataParallel)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from d2lgpu.exercises import attempt, expect, expect_close, expect_value_error, passed
from d2lgpu.replicas import ReplicasOnOneDevice, scaled_learning_rate


class _RowRecorder(nn.Module):
    """Records the row indices (column 0 of its input) of every call, as the chapter's does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.seen: list[list[int]] = []

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        self.seen.append(X[:, 0].long().tolist())
        return self.linear(X)


def replica_rows(fn: Callable[[int, int], list[list[int]]]) -> None:
    """Exercise 4.1: ``fn(n, k)``, the rows each replica that gets any receives."""
    ex = "4.1"
    for n, k in ((10, 4), (8, 4), (6, 4), (2, 4), (7, 3), (1, 1), (16, 8), (9, 2), (5, 4)):
        got = attempt(ex, fn, n, k)
        expect(ex, isinstance(got, (list, tuple)),
               f"return a list with one list of row indices per replica, got {type(got).__name__}")
        got = [[int(i) for i in rows] for rows in got]
        recorder = _RowRecorder()
        ReplicasOnOneDevice(recorder, k).train()(torch.stack([torch.arange(float(n)),
                                                              torch.zeros(n)], dim=1))
        want = recorder.seen
        note = f"; only {len(want)} of the {k} replicas get rows" if len(want) < k else ""
        expect(ex, got == want,
               f"replica_rows({n}, {k}) gave {got}; DataParallel's scatter (torch.chunk) gives "
               f"{want}: pieces of ceil({n}/{k}) = {-(-n // k)} rows, the last one what is "
               f"left{note}")
    passed(ex, "10 rows on 4 replicas: 3, 3, 3 and 1 rows; 6 rows: only 3 replicas get any")


def _bn(momentum: float, seed: int) -> nn.BatchNorm1d:
    generator = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm1d(3, momentum=momentum).double()
    with torch.no_grad():  # running statistics from earlier steps, not the fresh 0 and 1
        bn.running_mean.copy_(torch.randn(3, generator=generator, dtype=torch.float64))
        bn.running_var.copy_(torch.rand(3, generator=generator, dtype=torch.float64) + 0.5)
    return bn


def _rows(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3, generator=generator, dtype=torch.float64) * 2
            + torch.arange(float(n), dtype=torch.float64).unsqueeze(1))  # rows differ


def _pair(value: object, ex: str, call: str) -> tuple[torch.Tensor, torch.Tensor]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, torch.Tensor) for v in value)
    expect(ex, ok, f"{call} must return two tensors (mean, variance), got {type(value).__name__}")
    return value[0], value[1]


def replica0_running_stats(
    fn: Callable[[nn.BatchNorm1d, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Exercise 4.2: ``fn(bn, batch, k)``, the running statistics ``bn`` keeps after a training
    forward through k replicas, without changing ``bn``."""
    ex = "4.2"
    for n, k, momentum in ((12, 4, 0.1), (12, 3, 0.1), (11, 4, 0.5), (12, 1, 0.1),
                           (9, 2, 0.25)):
        bn = _bn(momentum, seed=n + k)
        batch = _rows(n, seed=k)
        before = [b.clone() for b in bn.buffers()]
        call = f"replica0_running_stats(bn with momentum {momentum}, {n} rows, k={k})"
        mean, var = _pair(attempt(ex, fn, bn, batch, k), ex, call)
        expect(ex, all(torch.equal(a, b) for a, b in zip(before, bn.buffers(), strict=True)),
               f"{call} changed bn's buffers: compute the statistics, leave bn as it was "
               "(copy.deepcopy(bn) if you want to run it)")
        reference = copy.deepcopy(bn)
        ReplicasOnOneDevice(reference, k).train()(batch)
        chunk0 = batch.chunk(k)[0]
        whole_mean = (1 - momentum) * bn.running_mean + momentum * batch.mean(dim=0)
        expect(ex, mean.shape == var.shape == (3,), f"{call}: expected two tensors of shape (3,), "
               f"got {tuple(mean.shape)} and {tuple(var.shape)}")
        expect(ex, not (k > 1 and torch.allclose(mean, whole_mean)),
               f"{call}: your running mean uses the whole batch; under DataParallel only "
               f"replica 0's update survives, and replica 0 saw rows 0 to {len(chunk0) - 1}")
        expect(ex, torch.allclose(mean, reference.running_mean, rtol=1e-9, atol=1e-12),
               f"{call}: running mean {mean.tolist()}, expected "
               f"{reference.running_mean.tolist()} = (1 - momentum) * old + momentum * the "
               "mean of replica 0's rows")
        biased = (1 - momentum) * bn.running_var + momentum * chunk0.var(dim=0, unbiased=False)
        expect(ex, not torch.allclose(var, biased, rtol=1e-9, atol=1e-12),
               f"{call}: your running variance uses the biased variance (divided by the row "
               "count); batch norm normalises with it, but its running variance keeps the "
               "unbiased one (divided by the row count - 1)")
        expect(ex, torch.allclose(var, reference.running_var, rtol=1e-9, atol=1e-12),
               f"{call}: running variance {var.tolist()}, want {reference.running_var.tolist()}")
    passed(ex, "after one step the module keeps replica 0's mean and unbiased variance, "
               "mixed in by its momentum")


def combine_shard_stats(
    fn: Callable[[list[int], list[torch.Tensor], list[torch.Tensor]],
                 tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Exercise 4.3: ``fn(counts, means, variances)``, the mean and biased variance of all the
    shards' rows from each shard's."""
    ex = "4.3"
    generator = torch.Generator().manual_seed(0)
    for sizes in ((4, 4), (3, 5, 1, 7), (12,), (2, 9, 4), (5, 0, 6)):
        shards = [torch.randn(n, 3, generator=generator, dtype=torch.float64) * (1 + i)
                  + 3 * i for i, n in enumerate(sizes)]
        nan = torch.full((3,), float("nan"), dtype=torch.float64)
        means = [s.mean(dim=0) if len(s) else nan for s in shards]  # NaN for an empty shard
        variances = [s.var(dim=0, unbiased=False) if len(s) else nan for s in shards]
        call = f"combine_shard_stats for shards of {list(sizes)} rows"
        mean, var = _pair(attempt(ex, fn, list(sizes), means, variances), ex, call)
        everything = torch.cat(shards)
        hint = (" (an empty shard, count 0, has NaN statistics: leave it out, as "
                "SyncBatchNorm does)" if 0 in sizes else "")
        expect(ex, torch.allclose(mean, everything.mean(dim=0), rtol=1e-9, atol=1e-12),
               f"{call}: mean {mean.tolist()}, expected {everything.mean(dim=0).tolist()}, "
               f"the shard means weighted by their counts{hint}")
        want_var = everything.var(dim=0, unbiased=False)
        expect(ex, torch.allclose(var, want_var, rtol=1e-9, atol=1e-12),
               f"{call}: variance {var.tolist()}, expected {want_var.tolist()}; the spread of "
               "the shard means around the overall mean counts too, not only the shards' "
               f"own variances{hint}")
        # With these, the running statistics are those of one batch norm over all the rows.
        n = len(everything)
        bn = nn.BatchNorm1d(3, momentum=0.1).double().train()
        bn(everything)
        running_var = 0.9 * 1.0 + 0.1 * var * n / (n - 1)
        expect(ex, torch.allclose(running_var, bn.running_var, rtol=1e-9, atol=1e-12)
               and torch.allclose(0.1 * mean, bn.running_mean, rtol=1e-9, atol=1e-12),
               f"{call}: your statistics do not give the running statistics of one batch "
               "norm over all the rows")
    passed(ex, "counts, means and variances of the shards give the statistics of the whole "
               "batch, as SyncBatchNorm's all-gather does")


def warmup_lambda(fn: Callable[[float, int, int], Callable[[int], float]]) -> None:
    """Exercise 4.4: ``fn(base_lr, k, warmup_steps)``, a LambdaLR factor ramping the rate from
    base_lr to scaled_learning_rate(base_lr, k) in warmup_steps steps."""
    ex = "4.4"
    for base_lr, k, warmup in ((0.1, 8, 5), (0.1, 2, 4), (0.05, 4, 1), (0.1, 1, 3),
                               (0.3, 4, 10), (0.02, 8, 6)):
        target = scaled_learning_rate(base_lr, k)
        factor = attempt(ex, fn, base_lr, k, warmup)
        expect(ex, callable(factor), f"warmup_lambda({base_lr}, {k}, {warmup}) must return a "
               f"function of the step number, got {type(factor).__name__}")
        weight = nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([weight], lr=target)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        for step in range(warmup + 3):
            want = base_lr + (target - base_lr) * min(step, warmup) / warmup
            expect_close(ex, optimizer.param_groups[0]["lr"], want, f"with base_lr={base_lr}, "
                         f"k={k}, warmup_steps={warmup}, the SGD learning rate at step {step} "
                         f"(the scheduler multiplies {target:g} by your factor)", 1e-9)
            optimizer.step()
            scheduler.step()
    expect_value_error(ex, fn, (0.1, 8, 0),
                        "a warm-up of 0 steps has nothing to ramp over (use no scheduler)")
    passed(ex, "k = 8 from 0.1: the rate climbs 0.1, 0.16, 0.22, 0.28, 0.34, then holds at "
               "the cap, 0.4")
