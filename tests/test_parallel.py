"""Tests for d2lgpu.parallel: splitting, allreduce, replicas, and k-way training."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from d2lgpu.parallel import (
    allreduce,
    data_parallel_step,
    max_abs_difference,
    replicate_params,
    split_batch,
)

CPU = torch.device("cpu")


# --- split_batch -------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(10, 1), (10, 2), (10, 3), (7, 7), (11, 4)])
def test_split_batch_covers_the_batch_in_order_with_even_shards(n: int, k: int) -> None:
    X = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    y = torch.arange(n)
    X_shards, y_shards = split_batch(X, y, [CPU] * k)
    assert len(X_shards) == len(y_shards) == k
    # Concatenating the shards gives back the batch, in order.
    assert torch.equal(torch.cat(X_shards), X)
    assert torch.equal(torch.cat(y_shards), y)
    sizes = [s.shape[0] for s in X_shards]
    assert sizes == [s.shape[0] for s in y_shards]
    # As even as possible: the first n % k shards hold one more example.
    assert sizes == [n // k + 1] * (n % k) + [n // k] * (k - n % k)


def test_split_batch_accepts_device_strings() -> None:
    X_shards, y_shards = split_batch(torch.zeros(4, 2), torch.zeros(4), ["cpu", "cpu"])
    assert all(s.device == CPU for s in X_shards + y_shards)


def test_split_batch_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="X has 4 examples but y has 3"):
        split_batch(torch.zeros(4, 2), torch.zeros(3), [CPU])


def test_split_batch_rejects_fewer_examples_than_devices() -> None:
    with pytest.raises(ValueError, match="cannot split 2 examples across 3 devices"):
        split_batch(torch.zeros(2, 5), torch.zeros(2), [CPU] * 3)


@pytest.mark.gpu
def test_split_batch_moves_each_shard_to_its_device() -> None:
    devices = [torch.device("cuda", 0), CPU]
    X = torch.randn(5, 2)
    y = torch.arange(5)
    X_shards, y_shards = split_batch(X, y, devices)
    assert [s.device for s in X_shards] == [torch.device("cuda", 0), CPU]
    assert [s.device for s in y_shards] == [torch.device("cuda", 0), CPU]
    assert torch.equal(torch.cat([s.cpu() for s in X_shards]), X)


# --- allreduce ---------------------------------------------------------------


def test_allreduce_writes_the_sum_into_every_original_tensor() -> None:
    tensors = [torch.full((2, 3), float(i + 1)) for i in range(3)]
    originals = list(tensors)  # the same objects, to check identity afterwards
    expected = sum(t.clone() for t in tensors)  # 1 + 2 + 3 = 6 everywhere
    assert allreduce(tensors) is None
    for before, after in zip(originals, tensors, strict=True):
        assert after is before
        assert torch.equal(after, expected)
    assert torch.equal(expected, torch.full((2, 3), 6.0))


def test_allreduce_makes_replica_gradients_equal_to_their_sum() -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 2)
    replicas = replicate_params([w], CPU), replicate_params([w], CPU)
    inputs = torch.randn(3, 4), torch.randn(5, 4)
    for (p,), X in zip(replicas, inputs, strict=True):
        (X @ p).pow(2).sum().backward()
    grads = [p.grad for (p,) in replicas]
    grad_ids = [id(g) for g in grads]
    expected = grads[0].clone() + grads[1].clone()
    assert not torch.allclose(grads[0], grads[1])  # different shards, different gradients
    allreduce(grads)
    for (p,), gid in zip(replicas, grad_ids, strict=True):
        assert id(p.grad) == gid  # the stored gradient itself was updated
        assert torch.allclose(p.grad, expected)
    # The summed gradient is the gradient over both shards together.
    w_full = w.clone().requires_grad_(True)
    (torch.cat(inputs) @ w_full).pow(2).sum().backward()
    assert torch.allclose(replicas[0][0].grad, w_full.grad, atol=1e-5)


def test_allreduce_of_a_single_tensor_leaves_it_unchanged() -> None:
    t = torch.tensor([1.0, -2.0])
    allreduce([t])
    assert torch.equal(t, torch.tensor([1.0, -2.0]))


def test_allreduce_works_on_parameters_that_require_grad() -> None:
    params = [torch.ones(2, requires_grad=True), torch.full((2,), 2.0, requires_grad=True)]
    allreduce(params)
    assert all(torch.equal(p, torch.full((2,), 3.0)) for p in params)


def test_allreduce_names_missing_gradients() -> None:
    with pytest.raises(TypeError, match="backward"):
        allreduce([torch.zeros(2), None])  # type: ignore[list-item]


@pytest.mark.gpu
def test_allreduce_across_a_gpu_and_the_cpu() -> None:
    on_gpu = torch.full((1000,), 2.0, device="cuda")
    on_cpu = torch.full((1000,), 5.0)
    allreduce([on_gpu, on_cpu])
    assert on_gpu.device.type == "cuda" and on_cpu.device == CPU
    assert torch.equal(on_gpu.cpu(), torch.full((1000,), 7.0))
    assert torch.equal(on_cpu, torch.full((1000,), 7.0))


@pytest.mark.multigpu
def test_allreduce_across_two_gpus() -> None:
    a = torch.full((4096,), 1.0, device="cuda:0")
    b = torch.full((4096,), 3.0, device="cuda:1")
    allreduce([a, b])
    assert a.device == torch.device("cuda", 0) and b.device == torch.device("cuda", 1)
    assert torch.equal(a.cpu(), torch.full((4096,), 4.0))
    assert torch.equal(b.cpu(), torch.full((4096,), 4.0))


# --- replicate_params and max_abs_difference ---------------------------------


def test_replicate_params_makes_independent_leaves_that_require_grad() -> None:
    params = [torch.randn(3, 2, requires_grad=True), torch.zeros(2)]
    copies = replicate_params(params, CPU)
    assert len(copies) == 2
    for original, copy in zip(params, copies, strict=True):
        assert torch.equal(original.detach(), copy.detach())
        assert copy.requires_grad and copy.is_leaf
        assert copy.data_ptr() != original.data_ptr()
    with torch.no_grad():
        copies[1] += 1.0
    assert torch.equal(params[1], torch.zeros(2))  # the original did not move


def test_max_abs_difference_finds_the_largest_gap() -> None:
    a = [torch.zeros(3), torch.zeros(2, 2)]
    b = [torch.tensor([0.0, -0.5, 0.1]), torch.tensor([[0.0, 0.25], [0.0, 0.0]])]
    assert max_abs_difference(a, b) == 0.5
    assert max_abs_difference(a, a) == 0.0


def test_max_abs_difference_rejects_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="argument 2 is longer"):
        max_abs_difference([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)])
    with pytest.raises(ValueError, match="shape"):
        max_abs_difference([torch.zeros(2)], [torch.zeros(3)])


def test_max_abs_difference_counts_nan_as_a_difference() -> None:
    # max(0.0, nan) is 0.0 in Python: a NaN must not read as "equal".
    a = [torch.zeros(3)]
    b = [torch.tensor([0.0, float("nan"), 0.0])]
    assert max_abs_difference(a, b) == math.inf
    assert max_abs_difference(b, b) == math.inf  # NaN equals nothing, not even NaN
    assert max_abs_difference([torch.tensor([math.inf])], [torch.tensor([math.inf])]) == math.inf
    # A NaN in a later tensor is not hidden by a finite gap in an earlier one.
    assert max_abs_difference([torch.ones(2), torch.zeros(1)],
                              [torch.zeros(2), torch.tensor([float("nan")])]) == math.inf


def _no_cuda(monkeypatch) -> None:
    """Make this process look like a machine without a usable GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_cuda_without_a_gpu_says_why_in_split_batch_and_replicate_params(monkeypatch) -> None:
    _no_cuda(monkeypatch)
    with pytest.raises(RuntimeError, match="cannot use CUDA") as info:
        split_batch(torch.zeros(4, 2), torch.zeros(4), ["cpu", "cuda"])
    assert "python -m d2lgpu info" in str(info.value) and "try_gpu" in str(info.value)
    with pytest.raises(RuntimeError, match="cannot use CUDA"):
        replicate_params([torch.zeros(2)], "cuda:0")


def test_split_batch_names_a_gpu_that_does_not_exist(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="cuda:3 does not exist: this process sees 1 GPU"):
        split_batch(torch.zeros(4, 2), torch.zeros(4), ["cuda:0", "cuda:3"])


# --- data_parallel_step ------------------------------------------------------


def _mlp_forward(X: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    W1, b1, W2, b2 = params
    return torch.tanh(X @ W1 + b1) @ W2 + b2


def _mlp_params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(6, 8, generator=generator) * 0.5,
        torch.zeros(8),
        torch.randn(8, 3, generator=generator) * 0.5,
        torch.zeros(3),
    ]


def _train(devices: list[torch.device], batches, lr: float = 0.5) -> list[list[torch.Tensor]]:
    replicas = [replicate_params(_mlp_params(), d) for d in devices]
    for X, y in batches:
        data_parallel_step(_mlp_forward, replicas, X, y, lr)
    return replicas


def _batches(batch_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(batch_size, 6, generator=generator),
            torch.randint(0, 3, (batch_size,), generator=generator),
        )
        for _ in range(steps)
    ]


@pytest.mark.parametrize("k", [2, 3])
def test_k_way_training_matches_one_device_on_the_whole_batch(k: int) -> None:
    batches = _batches(batch_size=10, steps=8)  # 10 examples: shards 5+5 and 4+3+3
    one = _train([CPU], batches)
    many = _train([CPU] * k, batches)
    # The parameters really moved, so agreeing is not trivial.
    assert max_abs_difference(one[0], _mlp_params()) > 1e-2
    assert max_abs_difference(one[0], many[0]) < 1e-5
    # All replicas stayed equal to each other.
    for replica in many[1:]:
        assert max_abs_difference(many[0], replica) == 0.0


def test_averaging_shard_means_is_wrong_for_uneven_shards() -> None:
    """Guards the reason for summing: a mean loss per shard weights small shards up."""
    X, y = _batches(batch_size=10, steps=1)[0]
    params = replicate_params(_mlp_params(), CPU)
    F.cross_entropy(_mlp_forward(X, params), y).backward()
    full_grads = [p.grad for p in params]
    X_shards, y_shards = split_batch(X, y, [CPU] * 3)  # 4 + 3 + 3
    replicas = [replicate_params(_mlp_params(), CPU) for _ in range(3)]
    for p, Xs, ys in zip(replicas, X_shards, y_shards, strict=True):
        (F.cross_entropy(_mlp_forward(Xs, p), ys) / 3).backward()
    for i in range(len(params)):
        allreduce([r[i].grad for r in replicas])
    assert max_abs_difference(full_grads, [p.grad for p in replicas[0]]) > 1e-4


def test_data_parallel_step_returns_the_mean_loss_before_the_update() -> None:
    X, y = _batches(batch_size=9, steps=1)[0]
    params = _mlp_params()
    expected = F.cross_entropy(_mlp_forward(X, params), y).item()
    replicas = [replicate_params(params, CPU) for _ in range(2)]
    loss = data_parallel_step(_mlp_forward, replicas, X, y, lr=0.1)
    assert loss == pytest.approx(expected, rel=1e-6)
    assert all(p.grad is None for r in replicas for p in r)  # gradients cleared


def test_data_parallel_step_rejects_a_mean_reduced_loss() -> None:
    X, y = _batches(batch_size=4, steps=1)[0]
    replicas = [replicate_params(_mlp_params(), CPU)]
    with pytest.raises(ValueError, match="reduction='none'"):
        data_parallel_step(_mlp_forward, replicas, X, y, 0.1, loss_fn=F.cross_entropy)


@pytest.mark.gpu
def test_data_parallel_step_on_a_gpu_and_the_cpu_matches_one_device() -> None:
    batches = _batches(batch_size=10, steps=5)
    one = _train([CPU], batches)
    mixed = _train([torch.device("cuda", 0), CPU], batches)
    assert mixed[0][0].device.type == "cuda"
    assert max_abs_difference(one[0], mixed[0]) < 1e-4
    assert max_abs_difference(mixed[0], mixed[1]) < 1e-6


@pytest.mark.multigpu
def test_data_parallel_step_on_two_gpus_matches_one_device() -> None:
    batches = _batches(batch_size=10, steps=5)
    one = _train([CPU], batches)
    two = _train([torch.device("cuda", 0), torch.device("cuda", 1)], batches)
    assert max_abs_difference(one[0], two[0]) < 1e-4
    assert max_abs_difference(two[0], two[1]) < 1e-6


# --- bad input and silent results ---------------------------------------------


def _linear(X: torch.Tensor, params) -> torch.Tensor:
    return X @ params[0] + params[1]


def _problem():
    gen = torch.Generator().manual_seed(0)
    W = [torch.randn(4, 3, generator=gen) * 0.1, torch.zeros(3)]
    X = torch.randn(8, 4, generator=gen)
    y = torch.randint(0, 3, (8,), generator=gen)
    return W, X, y


@pytest.mark.parametrize("lr", [math.nan, math.inf, None, "0.1", True, -0.1])
def test_data_parallel_step_refuses_a_learning_rate_that_is_not_one(lr) -> None:
    W, X, y = _problem()
    replicas = [replicate_params(W, CPU) for _ in range(2)]
    with pytest.raises(ValueError, match=r"^lr must be a positive finite number"):
        data_parallel_step(_linear, replicas, X, y, lr)


def _refused_and_unchanged(replicas, X, y, lr, error, match) -> None:
    before = [[p.detach().clone() for p in r] for r in replicas]
    with pytest.raises(error, match=match):
        data_parallel_step(_linear, replicas, X, y, lr)
    for params, saved in zip(replicas, before, strict=True):  # the step was not applied
        for p, q in zip(params, saved, strict=True):
            assert torch.allclose(p.detach(), q, rtol=0, atol=0, equal_nan=True)
            assert p.grad is None


def test_a_step_that_would_blow_the_weights_up_is_refused() -> None:
    W, X, y = _problem()
    replicas = [replicate_params(W, CPU) for _ in range(2)]
    _refused_and_unchanged(replicas, X, y, 1e6, FloatingPointError,
                           r"diverges at lr 1e\+06.*not applied")
    data_parallel_step(_linear, replicas, X, y, 0.1)  # a sensible lr still trains


def test_nan_in_the_inputs_is_blamed_on_the_data() -> None:
    W, X, y = _problem()
    X[3, 1] = math.nan
    replicas = [replicate_params(W, CPU) for _ in range(2)]
    _refused_and_unchanged(replicas, X, y, 0.1, ValueError, r"X holds 1 NaN or inf value")


def test_unequal_replicas_are_refused() -> None:
    W, X, y = _problem()
    replicas = [replicate_params(W, CPU), replicate_params([W[0] + 0.5, W[1]], CPU)]
    _refused_and_unchanged(replicas, X, y, 0.1, ValueError,
                           r"replicas hold different values \(largest gap 0.5\)")


def test_nan_weights_are_named_as_such() -> None:
    W, X, y = _problem()
    W[0][0, 0] = math.nan
    replicas = [replicate_params(W, CPU) for _ in range(2)]
    _refused_and_unchanged(replicas, X, y, 0.1, ValueError, r"parameters of replica 0 hold NaN")


@pytest.mark.parametrize("speeds, chosen", [
    ({2: [15000, 14000, 16000], 1: [8000, 8500, 9000]}, 2),  # quiet: the team is faster
    ({2: [15000, 900, 14000], 1: [8000, 8500, 7000]}, 1),  # one busy spell stalls the team
    ({2: [5000, 5000], 1: [5000, 6000]}, 1),  # equal worst repeats: fewer threads
    ({4: [100.0]}, 4),
])
def test_choose_cpu_threads_takes_the_best_worst_repeat(speeds, chosen):
    from d2lgpu.parallel import choose_cpu_threads

    assert choose_cpu_threads(speeds) == chosen


