"""d2lgpu.replicas: DataParallel's arithmetic on one device, the lr rule, the seed verdict."""

import pytest
import torch
from torch import nn

from d2lgpu.models import small_cnn
from d2lgpu.replicas import (
    MAX_LR_FACTOR,
    ReplicasOnOneDevice,
    compare_across_seeds,
    scaled_learning_rate,
)


def test_rows_are_split_as_chunk_splits_them():
    seen = []

    class Recorder(nn.Module):
        def forward(self, X):
            seen.append(X[:, 0].tolist())
            return X

    out = ReplicasOnOneDevice(Recorder(), 4)(torch.arange(10.0).unsqueeze(1))
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert out[:, 0].tolist() == list(range(10))


def test_a_batch_smaller_than_k_leaves_replicas_idle():
    calls = []

    class Counter(nn.Module):
        def forward(self, X):
            calls.append(len(X))
            return X

    ReplicasOnOneDevice(Counter(), 8)(torch.zeros(3, 2))
    assert calls == [1, 1, 1]


def test_batch_norm_statistics_come_from_replica_0():
    bn = nn.BatchNorm1d(2, momentum=1.0)
    X = torch.randn(12, 2) + torch.arange(12.0).unsqueeze(1)
    ReplicasOnOneDevice(bn, 3).train()(X)
    assert torch.allclose(bn.running_mean, X[:4].mean(dim=0), atol=1e-6)
    assert not torch.allclose(bn.running_mean, X.mean(dim=0), atol=1e-3)
    assert bn.num_batches_tracked.item() == 1


def test_gradients_without_batch_norm_equal_the_whole_batch():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    X, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    nn.functional.cross_entropy(ReplicasOnOneDevice(net, 3)(X), y).backward()
    split = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    nn.functional.cross_entropy(net(X), y).backward()
    pairs = zip(split, net.parameters(), strict=True)
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in pairs)


def test_eval_mode_computes_what_the_module_computes():
    torch.manual_seed(0)
    net = small_cnn().eval()
    X = torch.randn(9, 1, 28, 28)
    calls = []
    net.register_forward_pre_hook(lambda module, args: calls.append(len(args[0])))
    with torch.no_grad():
        split = ReplicasOnOneDevice(net, 4).eval()(X)
        calls_split = list(calls)
        assert torch.allclose(split, net(X), atol=1e-5)
    assert calls_split == [3, 3, 3]


def test_scaled_learning_rate_is_linear_then_capped():
    assert scaled_learning_rate(0.1, 1) == pytest.approx(0.1)
    assert scaled_learning_rate(0.1, 2) == pytest.approx(0.2)
    assert scaled_learning_rate(0.1, 4) == pytest.approx(0.4)
    assert scaled_learning_rate(0.1, 8) == pytest.approx(0.1 * MAX_LR_FACTOR) == 0.4
    assert scaled_learning_rate(0.2, 8) == pytest.approx(0.8)  # the cap follows the base rate


def test_the_capped_rate_trains_finite_at_8_replicas():
    # The largest device count chapter 4 uses, at the rule's rate, from a random start.
    torch.manual_seed(0)
    net = small_cnn()
    model = ReplicasOnOneDevice(net, 8)
    optimizer = torch.optim.SGD(net.parameters(), lr=scaled_learning_rate(0.1, 8))
    X, y = torch.rand(256, 1, 28, 28), torch.randint(0, 10, (256,))
    losses = []
    for _ in range(15):
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_verdict_on_both_sides_of_the_margin():
    clearly_higher = compare_across_seeds([0.80, 0.82, 0.81], [0.70, 0.71, 0.72])
    assert clearly_higher.verdict == "higher"
    assert clearly_higher.difference == pytest.approx(0.10)
    clearly_lower = compare_across_seeds([0.70, 0.71, 0.72], [0.80, 0.82, 0.81])
    assert clearly_lower.verdict == "lower"
    # A similar mean difference, but seed by seed it changes sign: a tie.
    tie = compare_across_seeds([0.90, 0.60, 0.95], [0.70, 0.71, 0.72])
    assert tie.difference == pytest.approx(0.1067, abs=1e-3)
    assert tie.verdict == "tie"


def test_verdict_just_inside_and_just_outside_the_margin():
    b = [0.5, 0.5, 0.5]
    spread = [0.0, 0.1, 0.2]  # differences with standard deviation 0.1
    margin = 2 * 0.1 / 3 ** 0.5
    shift_out = margin * 1.01 - 0.1  # mean difference just above the margin
    shift_in = margin * 0.99 - 0.1
    just_out = compare_across_seeds([0.5 + d + shift_out for d in spread], b)
    just_in = compare_across_seeds([0.5 + d + shift_in for d in spread], b)
    assert just_out.margin == pytest.approx(margin)
    assert just_out.verdict == "higher"
    assert just_in.verdict == "tie"


def test_verdict_needs_paired_seeds_and_finite_scores():
    with pytest.raises(ValueError, match="at least 2"):
        compare_across_seeds([0.8], [0.7])
    with pytest.raises(ValueError, match="same seeds"):
        compare_across_seeds([0.8, 0.81], [0.7, 0.71, 0.72])
    with pytest.raises(ValueError, match="NaN"):
        compare_across_seeds([0.8, float("nan")], [0.7, 0.71])
