"""Checks for chapter 3's exercises (data parallelism from scratch)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from d2lgpu.exercises import attempt, expect, expect_close, expect_value_error, passed
from d2lgpu.parallel import (
    allreduce,
    data_parallel_step,
    max_abs_difference,
    replicate_params,
    split_batch,
)

CPU = torch.device("cpu")


def _in_place(fn: Callable[..., object]) -> Callable[..., bool]:
    """``fn`` for :func:`attempt` when it returns None, working in place as allreduce does."""

    @functools.wraps(fn)  # keeps fn's name for the "not done yet" message
    def call(*args: object) -> bool:
        fn(*args)
        return True

    return call


def _mlp(X: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A small functional network, called like the chapter's lenet(X, params)."""
    W1, b1, W2, b2 = params
    return F.relu(X @ W1 + b1) @ W2 + b2


def _mlp_params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) / (2 if len(shape) > 1
            else 10) for shape in ((4, 6), (6,), (6, 3), (3,))]


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=generator))


def shard_bounds(fn: Callable[[int, int], list[tuple[int, int]]]) -> None:
    """Exercise 3.1: ``fn(n, k)`` gives the rows (start, stop) of each of split_batch's shards."""
    ex = "3.1"
    for n, k in ((7, 3), (10, 4), (8, 4), (4, 4), (1, 1), (13, 5), (64, 3), (9, 2)):
        got = attempt(ex, fn, n, k)
        expect(ex, isinstance(got, (list, tuple)),
               f"return a list of (start, stop) pairs, got {type(got).__name__}")
        got = [tuple(pair) for pair in got]
        _, shards = split_batch(torch.arange(n), torch.arange(n), [CPU] * k)
        want = [(int(s[0]), int(s[-1]) + 1) for s in shards]
        expect(ex, got == want,
               f"shard_bounds({n}, {k}) gave {got}; d2lgpu.split_batch cuts {n} rows into "
               f"{want}: the first {n} % {k} = {n % k} shards get one row more")
    expect_value_error(ex, fn, (2, 3), "2 rows over 3 devices leave a device without a shard")
    passed(ex, "10 rows over 4 devices are rows 0-2, 3-5, 6-7 and 8-9, as split_batch cuts "
               "them")


def _one_step_summed_means(lr: float, sizes: Sequence[int], X: torch.Tensor, y: torch.Tensor,
                           ) -> list[torch.Tensor]:
    """Replica 0's parameters after a step where each replica backpropagates its shard's *mean*
    loss and the all-reduce sums."""
    replicas = [replicate_params(_mlp_params(), CPU) for _ in sizes]
    X_shards, y_shards = X.split(list(sizes)), y.split(list(sizes))
    for params, X_shard, y_shard in zip(replicas, X_shards, y_shards, strict=True):
        F.cross_entropy(_mlp(X_shard, params), y_shard).backward()
    for i in range(len(replicas[0])):
        allreduce([params[i].grad for params in replicas])
    with torch.no_grad():
        for params in replicas:
            for p in params:
                p -= lr * p.grad
    return replicas[0]


def lr_for_summed_means(fn: Callable[[float, list[int]], float]) -> None:
    """Exercise 3.2: ``fn(lr, shard_sizes)``, the rate at which summed shard means take the
    chapter's step, or a ValueError where none does."""
    ex = "3.2"
    for lr, sizes in ((0.1, [8, 8]), (0.3, [5, 5, 5]), (0.2, [4, 4, 4, 4]), (0.1, [10])):
        got = attempt(ex, fn, lr, list(sizes))
        expect_close(ex, got, lr / len(sizes), f"lr_for_summed_means({lr}, {sizes})", 1e-9)
        X, y = _batch(sum(sizes), seed=len(sizes))
        theirs = [replicate_params(_mlp_params(), CPU) for _ in sizes]
        data_parallel_step(_mlp, theirs, X, y, lr)
        mine = _one_step_summed_means(float(got), sizes, X, y)
        gap = max_abs_difference(mine, theirs[0])
        expect(ex, gap < 1e-12,
               f"with shards {sizes}, a step at your rate {got} ends {gap:.1e} away from "
               f"d2lgpu.data_parallel_step at lr={lr}")
    for sizes in ([3, 2, 2], [14, 13, 13], [9, 1], [6, 4, 2], [2, 2, 1, 1]):
        expect_value_error(ex, fn, (0.1, list(sizes)),
                            f"with uneven shards {sizes} no single learning rate turns the sum "
                            "of the shards' mean gradients into the full-batch gradient")
    passed(ex, "k equal shards: lr / k; uneven shards: no learning rate repairs the weights")


def weighted_allreduce(fn: Callable[[list[torch.Tensor], list[float]], None]) -> None:
    """Exercise 3.3: ``fn(tensors, weights)`` leaves the weighted mean in every tensor."""
    ex = "3.3"
    call = _in_place(fn)
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0]), torch.tensor([100.0, 200.0])
    tensors = [a, b, c]
    attempt(ex, call, tensors, [1, 1, 2])
    want = torch.tensor([52.75, 105.5])  # (1 * a + 1 * b + 2 * c) / 4
    expect(ex, all(t is u for t, u in zip(tensors, (a, b, c), strict=True)),
           "the list must hold the caller's tensors afterwards: write into them")
    for name, t in zip("abc", (a, b, c), strict=True):
        expect(ex, torch.allclose(t, want),
               f"with tensors a = [1, 2], b = [10, 20], c = [100, 200] and weights [1, 1, 2], "
               f"{name} holds {t.tolist()} afterwards, expected (a + b + 2c) / 4 = "
               f"{want.tolist()} in every tensor; write with copy_, as the chapter's allreduce "
               "does (assigning to a loop variable changes nothing)")
    # The use: replicas that backpropagate their shard's mean loss, weighted by shard size.
    params = _mlp_params()
    X, y = _batch(10, seed=3)
    full = replicate_params(params, CPU)
    F.cross_entropy(_mlp(X, full), y).backward()
    for k in (2, 3, 4):
        replicas = [replicate_params(params, CPU) for _ in range(k)]
        X_shards, y_shards = split_batch(X, y, [CPU] * k)
        for shard_params, X_shard, y_shard in zip(replicas, X_shards, y_shards, strict=True):
            F.cross_entropy(_mlp(X_shard, shard_params), y_shard).backward()
        sizes = [len(s) for s in y_shards]
        for i in range(len(params)):
            attempt(ex, call, [r[i].grad for r in replicas], sizes)
        grads = [[p.grad for p in r] for r in replicas]
        expect(ex, all(max_abs_difference(grads[0], g) == 0.0 for g in grads[1:]),
               f"after weighted_allreduce over {k} replicas their gradients differ")
        gap = max_abs_difference(grads[0], [p.grad for p in full])
        expect(ex, gap < 1e-12,
               f"10 rows over {k} replicas (shards {sizes}), each backpropagating its shard's "
               f"mean loss, weighted by the shard sizes: the gradient is {gap:.1e} away from "
               "the full-batch gradient")
    expect_value_error(ex, call, ([torch.ones(2), torch.ones(2), torch.ones(2)], [1.0, 2.0]),
                        "3 tensors and 2 weights do not pair up")
    expect_value_error(ex, call, ([torch.ones(2), torch.ones(2)], [0.0, 0.0]),
                        "weights [0, 0] have no mean (their sum is 0)")
    passed(ex, "shard means weighted by shard sizes give the full-batch gradient for uneven "
               "shards too")


def accumulated_step(
    fn: Callable[[Callable, list[torch.Tensor], torch.Tensor, torch.Tensor, float, int], float],
) -> None:
    """Exercise 3.4: ``fn(forward, params, X, y, lr, k)``: k shards' gradients accumulated on
    one set of parameters take data_parallel_step's step."""
    ex = "3.4"
    batches = [_batch(10, seed=10), _batch(10, seed=11)]
    for k in (1, 2, 3, 4):
        params = replicate_params(_mlp_params(), CPU)
        originals = list(params)
        replicas = [replicate_params(_mlp_params(), CPU) for _ in range(k)]
        for step, (X, y) in enumerate(batches, start=1):
            loss = attempt(ex, fn, _mlp, params, X, y, 0.5, k)
            want = data_parallel_step(_mlp, replicas, X, y, 0.5)
            expect_close(ex, loss, want, f"with k={k}, the loss returned at step {step} (the "
                         "shards' summed losses, each divided by the whole batch's size)")
            expect(ex, all(p is q for p, q in zip(params, originals, strict=True)),
                   "update the parameters in place (p -= lr * p.grad under torch.no_grad()), "
                   "as the chapter's step does; the list must keep its tensors")
            gap = max_abs_difference(params, replicas[0])
            hint = (" (the second step starts from gradients the first left behind: set "
                    "p.grad = None after the update)" if step == 2 else "")
            expect(ex, gap < 1e-12,
                   f"with 10 rows in k={k} shards, after step {step} the parameters are "
                   f"{gap:.1e} away from d2lgpu.data_parallel_step on {k} replica(s): each "
                   f"shard's loss is summed and divided by the whole batch's size{hint}")
    X, y = batches[0]
    params = replicate_params(_mlp_params(), CPU)
    expect_value_error(ex, fn, (_mlp, params, X[:3], y[:3], 0.5, 4), "3 rows cannot make 4 shards")
    passed(ex, "k shards accumulated on one device take the step of k replicas, loss and "
               "parameters")
