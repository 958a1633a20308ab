"""What ``d2lgpu.train`` costs over a bare PyTorch loop doing the same work, on the CPU.

Both train the same model (the small CNN) from the same seed on the same synthetic
Fashion-MNIST-shaped data, with the same batches, SGD steps and per-epoch evaluation:

* the bare loop is what a learner writes: seed, Xavier initialisation, then per epoch
  ``zero_grad``/forward/loss/``backward``/``step`` over the training batches, the loss
  and correct counts summed, and an accuracy pass over the test batches;
* ``d2lgpu.train(..., progress=False)`` does the same with its checks,
  precision policy, warm-up hook and history on top.

The two run in turns (bare, train, train, bare, ...) so that a busy spell of a shared
machine falls on both alike, and the verdict compares the median of the per-round
ratios ``train / bare`` with the budget (5 % by default). It gives a verdict only when
the middle half of the ratios (their quartiles) lies on one side of the budget; when the
quartiles straddle it, it says the machine was too noisy to judge.

    python benchmarks/train_overhead.py             # 15 rounds, about half a minute
    python benchmarks/train_overhead.py --rounds 31 --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn
from torch.utils import data

import d2lgpu


def synthetic_loaders(
    train_size: int, test_size: int, batch_size: int, seed: int = 0
) -> tuple[data.DataLoader, data.DataLoader]:
    """Fashion-MNIST-shaped random images (normalised floats) and labels, in memory.

    In memory and without worker processes, so that the loop, not data loading, is timed.
    """
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(train_size + test_size, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (train_size + test_size,), generator=g)
    train = data.TensorDataset(X[:train_size], y[:train_size])
    test = data.TensorDataset(X[train_size:], y[train_size:])
    # Not shuffled: both loops then see the very same batches in the same order.
    return data.DataLoader(train, batch_size), data.DataLoader(test, batch_size)


def bare_loop(net: nn.Module, train_iter, test_iter, num_epochs: int, lr: float,
              seed: int) -> float:
    """The plain PyTorch loop; returns the last epoch's test accuracy."""
    torch.manual_seed(seed)
    for m in net.modules():  # fresh weights, as d2lgpu.train's init does
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    test_acc = 0.0
    for _ in range(num_epochs):
        net.train()
        loss_sum, correct, count = torch.zeros(()), torch.zeros((), dtype=torch.int64), 0
        for X, y in train_iter:
            optimizer.zero_grad(set_to_none=True)
            y_hat = net(X)
            loss = loss_fn(y_hat, y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * y.numel()
            correct += (y_hat.detach().argmax(dim=1) == y).sum()
            count += y.numel()
        net.eval()
        hits, total = torch.zeros((), dtype=torch.int64), 0
        with torch.no_grad():
            for X, y in test_iter:
                hits += (net(X).argmax(dim=1) == y).sum()
                total += y.numel()
        test_acc = hits.item() / total
    return test_acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved pairs of runs")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--test-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: least disturbed by other work)")
    parser.add_argument("--budget", type=float, default=0.05,
                        help="allowed overhead of d2lgpu.train, as a fraction")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lr, seed = 0.1, 0
    train_iter, test_iter = synthetic_loaders(args.train_size, args.test_size, args.batch_size)

    def run_bare() -> float:
        return bare_loop(d2lgpu.small_cnn(), train_iter, test_iter, args.epochs, lr, seed)

    def run_train() -> float:
        history = d2lgpu.train(d2lgpu.small_cnn(), train_iter, test_iter, args.epochs, lr,
                               "cpu", seed=seed, progress=False)
        return history.test_acc[-1]

    run_bare(), run_train()  # warm-up: first calls pay for lazy imports and allocations
    times: dict[str, list[float]] = {"bare loop": [], "d2lgpu.train": []}
    accuracies: dict[str, float] = {}
    for i in range(args.rounds):
        order = [("bare loop", run_bare), ("d2lgpu.train", run_train)]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            accuracies[name] = fn()
            times[name].append(time.perf_counter() - start)
    ratios = [t / b for t, b in zip(times["d2lgpu.train"], times["bare loop"], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    overhead = statistics.median(ratios) - 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} thread(s), load average {load:.2f}; small CNN, "
          f"{args.train_size} train / {args.test_size} test examples, batch {args.batch_size}, "
          f"{args.epochs} epochs, {args.rounds} interleaved rounds")
    for name, values in times.items():
        print(f"{name:<13} median {statistics.median(values):.3f} s  "
              f"(min {min(values):.3f}, max {max(values):.3f})")
    same = accuracies["bare loop"] == accuracies["d2lgpu.train"]
    print(f"same work: both end with the same test accuracy: {same}")
    print(f"d2lgpu.train / bare loop, per round: median {1 + overhead:.3f}, "
          f"quartiles {q1:.3f} to {q3:.3f}")
    limit = 1 + args.budget
    if q3 <= limit:
        print(f"overhead {overhead:+.1%}: within the {args.budget:.0%} budget (three rounds "
              f"in four or more are)")
    elif q1 > limit:
        print(f"overhead {overhead:+.1%}: over the {args.budget:.0%} budget (three rounds "
              f"in four or more are)")
    else:
        print(f"spread too wide to judge: the quartiles straddle the {args.budget:.0%} budget "
              f"(the machine is busy; run again when it is quieter)")


if __name__ == "__main__":
    main()
