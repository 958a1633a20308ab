"""Chapter 3's exercise checks fail on the stubs and on plausible wrong answers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from d2lgpu.exercises import ExerciseNotDone, ExerciseWrong
from d2lgpu.exercises import ch03 as check


def stub(*args):
    raise NotImplementedError


def chunk_bounds(n, k):
    # torch.chunk's rule: pieces of ceil(n / k) rows, the last one short.
    if n < k:
        raise ValueError(n)
    size = math.ceil(n / k)
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def larger_shards_last(n, k):
    if n < k:
        raise ValueError(n)
    size, extra = divmod(n, k)
    sizes = [size] * (k - extra) + [size + 1] * extra
    starts = [sum(sizes[:i]) for i in range(k + 1)]
    return [(starts[i], starts[i + 1]) for i in range(k)]


def no_refusal(n, k):
    size, extra = divmod(n, k)
    starts = [i * size + min(i, extra) for i in range(k + 1)]
    return [(starts[i], starts[i + 1]) for i in range(k)]


@pytest.mark.parametrize("wrong", [chunk_bounds, larger_shards_last, no_refusal])
def test_shard_bounds_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.shard_bounds(wrong)


def lr_times_k(lr, shard_sizes):
    return lr * len(shard_sizes)


def lr_unchanged(lr, shard_sizes):
    return lr


def lr_over_k_always(lr, shard_sizes):
    return lr / len(shard_sizes)


def refuses_only_indivisible_batches(lr, shard_sizes):
    if sum(shard_sizes) % len(shard_sizes):
        raise ValueError(shard_sizes)
    return lr / len(shard_sizes)


def refuses_only_gaps_above_one_row(lr, shard_sizes):
    if max(shard_sizes) - min(shard_sizes) > 1:
        raise ValueError(shard_sizes)
    return lr / len(shard_sizes)


@pytest.mark.parametrize("wrong", [lr_times_k, lr_unchanged, lr_over_k_always,
                                   refuses_only_indivisible_batches,
                                   refuses_only_gaps_above_one_row])
def test_lr_for_summed_means_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.lr_for_summed_means(wrong)


def rebinding(tensors, weights):
    if len(tensors) != len(weights) or sum(weights) == 0:
        raise ValueError(weights)
    total = sum(w * t for t, w in zip(tensors, weights, strict=True)) / sum(weights)
    for t in tensors:
        t = total  # noqa: F841, PLW2901 - the slip the chapter shows: rebinds a name only


def ignores_weights(tensors, weights):
    if len(tensors) != len(weights) or sum(weights) == 0:
        raise ValueError(weights)
    with torch.no_grad():
        mean = sum(tensors) / len(tensors)
        for t in tensors:
            t.copy_(mean)


@pytest.mark.parametrize("wrong", [rebinding, ignores_weights])
def test_weighted_allreduce_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.weighted_allreduce(wrong)


def shard_means(forward, params, X, y, lr, k):
    # Each shard's mean loss: the rows of a small shard weigh more.
    if len(X) < k:
        raise ValueError(k)
    total = 0.0
    for X_shard, y_shard in zip(X.tensor_split(k), y.tensor_split(k), strict=True):
        loss = F.cross_entropy(forward(X_shard, params), y_shard) / k
        loss.backward()
        total += loss.item()
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad = None
    return total


def keeps_old_gradients(forward, params, X, y, lr, k):
    if len(X) < k:
        raise ValueError(k)
    total = 0.0
    for X_shard, y_shard in zip(X.tensor_split(k), y.tensor_split(k), strict=True):
        loss = F.cross_entropy(forward(X_shard, params), y_shard, reduction="sum") / len(X)
        loss.backward()
        total += loss.item()
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad  # and the next step adds onto this gradient
    return total


@pytest.mark.parametrize("wrong", [shard_means, keeps_old_gradients])
def test_accumulated_step_refuses_wrong_answers(wrong):
    with pytest.raises(ExerciseWrong):
        check.accumulated_step(wrong)


@pytest.mark.parametrize("name", ["shard_bounds", "lr_for_summed_means",
                                  "weighted_allreduce", "accumulated_step"])
def test_every_check_refuses_its_stub(name):
    with pytest.raises(ExerciseNotDone):
        getattr(check, name)(stub)
