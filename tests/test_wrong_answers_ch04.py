"""Chapter 4's exercise checks refuse plausible wrong answers, each with a message that
points at the mistake, and accept the worked solutions (written out again here)."""

from __future__ import annotations

import contextlib
import io

import pytest

from d2lgpu.exercises import ExerciseWrong
from d2lgpu.exercises import ch04 as check
from d2lgpu.replicas import scaled_learning_rate


def _passes(check_fn, answer) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check_fn(answer)
    return out.getvalue()


# --- 4.1: who sees which rows --------------------------------------------------------------


def replica_rows(n, k):
    size = -(-n // k)
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]


def balanced_split(n, k):
    # Wrong: numpy's array_split (sizes differ by at most one), not torch.chunk's ceil pieces.
    base, extra = divmod(n, k)
    rows, start = [], 0
    for i in range(k):
        size = base + (i < extra)
        if size:
            rows.append(list(range(start, start + size)))
        start += size
    return rows


def keeps_idle_replicas(n, k):
    # Wrong: an empty list for every replica without rows.
    rows = replica_rows(n, k)
    return rows + [[] for _ in range(k - len(rows))]


def floor_pieces(n, k):
    # Wrong: pieces of n // k rows, the rest to the last replica.
    size = max(1, n // k)
    rows = [list(range(i * size, (i + 1) * size)) for i in range(min(k, n) - 1)]
    return rows + [list(range(len(rows) * size, n))]


@pytest.mark.parametrize("wrong", [balanced_split, keeps_idle_replicas, floor_pieces])
def test_4_1_refuses_wrong_splits(wrong):
    with pytest.raises(ExerciseWrong, match="torch.chunk"):
        check.replica_rows(wrong)


def test_4_1_accepts_the_solution():
    assert "Exercise 4.1 passed" in _passes(check.replica_rows, replica_rows)


# --- 4.2: batch-norm statistics after one step ---------------------------------------------


def replica0_running_stats(bn, batch, k):
    chunk0 = batch.chunk(k)[0]
    m = bn.momentum
    return ((1 - m) * bn.running_mean + m * chunk0.mean(dim=0),
            (1 - m) * bn.running_var + m * chunk0.var(dim=0, unbiased=True))


def whole_batch(bn, batch, k):
    # Wrong: the statistics of the whole batch, as one device would keep.
    return replica0_running_stats(bn, batch, 1)


def biased_variance(bn, batch, k):
    # Wrong: the variance batch norm normalises with, not the one it keeps.
    chunk0 = batch.chunk(k)[0]
    m = bn.momentum
    return ((1 - m) * bn.running_mean + m * chunk0.mean(dim=0),
            (1 - m) * bn.running_var + m * chunk0.var(dim=0, unbiased=False))


def runs_bn_in_place(bn, batch, k):
    # Wrong: right numbers, but bn's own buffers are updated on the way.
    bn.train()(batch.chunk(k)[0])
    return bn.running_mean.clone(), bn.running_var.clone()


def ignores_momentum(bn, batch, k):
    # Wrong: the chunk's statistics replace the running ones (momentum 1).
    chunk0 = batch.chunk(k)[0]
    return chunk0.mean(dim=0), chunk0.var(dim=0, unbiased=True)


@pytest.mark.parametrize(("wrong", "message"), [
    (whole_batch, "whole batch"),
    (biased_variance, "biased variance"),
    (runs_bn_in_place, "changed bn's buffers"),
    (ignores_momentum, "running mean"),
])
def test_4_2_refuses_wrong_statistics(wrong, message):
    with pytest.raises(ExerciseWrong, match=message):
        check.replica0_running_stats(wrong)


def test_4_2_accepts_the_solution():
    assert "Exercise 4.2 passed" in _passes(check.replica0_running_stats,
                                            replica0_running_stats)


# --- 4.3: SyncBatchNorm's combination -----------------------------------------------------


def combine_shard_stats(counts, means, variances):
    shards = [(n, mu, var) for n, mu, var in zip(counts, means, variances, strict=True) if n > 0]
    total = sum(n for n, _, _ in shards)
    mean = sum(n * mu for n, mu, _ in shards) / total
    var = sum(n * (var + (mu - mean) ** 2) for n, mu, var in shards) / total
    return mean, var


def unweighted(counts, means, variances):
    # Wrong: every shard counts the same, whatever its rows.
    shards = [(mu, var) for n, mu, var in zip(counts, means, variances, strict=True) if n > 0]
    return (sum(mu for mu, _ in shards) / len(shards),
            sum(var for _, var in shards) / len(shards))


def without_spread_of_means(counts, means, variances):
    # Wrong: the shards' own variances only, not how far their means lie from the overall one.
    shards = [(n, mu, var) for n, mu, var in zip(counts, means, variances, strict=True) if n > 0]
    total = sum(n for n, _, _ in shards)
    return (sum(n * mu for n, mu, _ in shards) / total,
            sum(n * var for n, _, var in shards) / total)


def keeps_empty_shards(counts, means, variances):
    # Wrong: an empty shard's NaN statistics poison the sums (0 * NaN is NaN).
    total = sum(counts)
    mean = sum(n * mu for n, mu in zip(counts, means, strict=True)) / total
    var = sum(n * (v + (mu - mean) ** 2)
              for n, mu, v in zip(counts, means, variances, strict=True)) / total
    return mean, var


@pytest.mark.parametrize(("wrong", "message"), [
    (unweighted, "expected"),  # equal shards first: caught on the variance
    (without_spread_of_means, "spread of the shard means"),
    (keeps_empty_shards, "empty shard"),
])
def test_4_3_refuses_wrong_combinations(wrong, message):
    with pytest.raises(ExerciseWrong, match=message):
        check.combine_shard_stats(wrong)


def test_4_3_accepts_the_solution():
    assert "Exercise 4.3 passed" in _passes(check.combine_shard_stats, combine_shard_stats)


# --- 4.4: a warm-up ------------------------------------------------------------------------


def warmup_lambda(base_lr, k, warmup_steps):
    if warmup_steps < 1:
        raise ValueError("warmup_steps must be at least 1")
    scaled = scaled_learning_rate(base_lr, k)

    def factor(step):
        return (base_lr + (scaled - base_lr) * min(step, warmup_steps) / warmup_steps) / scaled

    return factor


def no_warmup(base_lr, k, warmup_steps):
    # Wrong: the scaled rate from the first step.
    if warmup_steps < 1:
        raise ValueError("warmup_steps must be at least 1")
    return lambda step: 1.0


def rate_not_factor(base_lr, k, warmup_steps):
    # Wrong: returns the rate itself; LambdaLR multiplies the optimizer's rate by it.
    if warmup_steps < 1:
        raise ValueError("warmup_steps must be at least 1")
    scaled = scaled_learning_rate(base_lr, k)
    return lambda step: base_lr + (scaled - base_lr) * min(step, warmup_steps) / warmup_steps


def uncapped_target(base_lr, k, warmup_steps):
    # Wrong: ramps to base_lr * k, past the cap the optimizer was created with.
    if warmup_steps < 1:
        raise ValueError("warmup_steps must be at least 1")
    scaled = scaled_learning_rate(base_lr, k)
    return lambda step: (base_lr + (base_lr * k - base_lr) * min(step, warmup_steps)
                         / warmup_steps) / scaled


def one_step_late(base_lr, k, warmup_steps):
    # Wrong: counts steps from 1, so it reaches the scaled rate a step late.
    inner = warmup_lambda(base_lr, k, warmup_steps)
    return lambda step: inner(max(step - 1, 0))


def zero_steps_accepted(base_lr, k, warmup_steps):
    # Wrong: no ValueError for a warm-up of 0 steps.
    return warmup_lambda(base_lr, k, max(warmup_steps, 1))


@pytest.mark.parametrize(("wrong", "message"), [
    (no_warmup, "learning rate at step 0"),
    (rate_not_factor, "multiplies"),
    (uncapped_target, "learning rate at step"),
    (one_step_late, "learning rate at step 1"),
    (zero_steps_accepted, "0 steps"),
])
def test_4_4_refuses_wrong_warmups(wrong, message):
    with pytest.raises(ExerciseWrong, match=message):
        check.warmup_lambda(wrong)


def test_4_4_accepts_the_solution():
    assert "Exercise 4.4 passed" in _passes(check.warmup_lambda, warmup_lambda)

