"""Training speed of three loops side by side, in one run on one device.

1. ``d2l-style``: the loop most learners start from, as d2l's ``train_ch13`` works:
   fp32, a CPU DataLoader with worker processes decoding every batch, and metrics
   read with ``.item()`` after every batch (a host-device synchronisation per step).
2. ``d2lgpu.train``: the course's plain loop with its defaults (fp32, DataLoader,
   metrics summed on the device and read once per epoch).
3. ``train_fast``: the fast path (data on the device as uint8, device-side shuffling,
   channels_last on GPUs, precision 'auto', fused SGD, no per-step sync; optionally compiled).

All three train the same model from the same initialisation (``seed``) with the same
batch size, learning rate and epochs (the d2l recipe: batch 256, lr 0.1, 10 epochs of
ResNet-18 on 28x28 Fashion-MNIST). Printed per loop: seconds of the first epoch and the
median of the later ones (training only; the first includes one-off costs such as
cuDNN autotuning and compilation), images per second over the later epochs, total
training seconds, speed-up over the d2l-style loop (total time), the share of the
device's dense Tensor Core peak (bf16; fp16 on a T4 or V100) that the counted FLOPs
represent, and the final test accuracy.

    python benchmarks/train_speed.py                # full: ResNet-18, 10 epochs
    python benchmarks/train_speed.py --compile      # the fast path with torch.compile
    python benchmarks/train_speed.py --quick        # seconds on a CPU: small CNN, subset
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
from torch import nn
from torch.utils import data

import d2lgpu
from d2lgpu.chips import peak_format, peak_tflops, training_flops_per_example
from d2lgpu.data import fashion_mnist_on_device
from d2lgpu.fast import train_fast
from d2lgpu.timing import format_table
from d2lgpu.training import History, init_weights, set_seed

MODELS = {"resnet18": d2lgpu.resnet18, "small_cnn": d2lgpu.small_cnn}
LOOPS = ("d2l-style", "d2lgpu.train", "fast")


def train_d2l_style(
    net: nn.Module,
    train_iter: data.DataLoader,
    test_iter: data.DataLoader,
    num_epochs: int,
    lr: float,
    device: torch.device,
) -> History:
    """Plain fp32 SGD that reads loss and accuracy back to the host after every batch."""
    net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    history = History(device=str(device))
    for _ in range(num_epochs):
        net.train()
        start = time.perf_counter()
        loss_sum, correct, count = 0.0, 0.0, 0
        for X, y in train_iter:
            X, y = X.to(device), y.to(device)
            optimizer.zero_grad()
            y_hat = net(X)
            loss = loss_fn(y_hat, y)
            loss.backward()
            optimizer.step()
            # Each .item() waits until the GPU has finished the step: the host cannot
            # queue the next batch ahead, and the GPU idles while the host catches up.
            loss_sum += loss.item() * y.numel()
            correct += (y_hat.argmax(dim=1) == y).sum().item()
            count += y.numel()
        train_seconds = time.perf_counter() - start
        net.eval()
        test_correct, test_count = 0.0, 0
        with torch.no_grad():
            for X, y in test_iter:
                X, y = X.to(device), y.to(device)
                test_correct += (net(X).argmax(dim=1) == y).sum().item()
                test_count += y.numel()
        history.train_loss.append(loss_sum / count)
        history.train_acc.append(correct / count)
        history.test_acc.append(test_correct / test_count)
        history.epoch_seconds.append(time.perf_counter() - start)
        history.examples_per_second.append(count / train_seconds)
    return history


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def summarise(name: str, history: History, num_examples: int, flops_per_image: float,
              peak: float | None, baseline_seconds: float | None) -> list:
    """One table row; training time is ``num_examples / examples_per_second`` per epoch."""
    train_seconds = [num_examples / eps for eps in history.examples_per_second]
    later = train_seconds[1:] or train_seconds  # one epoch: nothing to leave out
    steady_seconds = statistics.median(later)
    images_per_second = num_examples / steady_seconds
    total = sum(train_seconds)
    if peak is None:
        share = "n/a"
    else:
        share = f"{100 * images_per_second * flops_per_image / (peak * 1e12):.1f}%"
    speedup = f"{baseline_seconds / total:.2f}x" if baseline_seconds else "1.00x"
    return [name, f"{train_seconds[0]:.2f}", f"{steady_seconds:.2f}", f"{images_per_second:.0f}",
            f"{total:.2f}", speedup, share, f"{history.test_acc[-1]:.3f}"]


def peak_header(device: torch.device, given: float | None = None) -> str:
    """The MFU column's heading, naming the peak's format: the data sheets give bf16 from
    Ampere on and fp16 for the T4 and V100 (no native bf16); ``--peak-tflops`` is the
    user's own number, of whatever format they took it from."""
    if given is not None:
        return "% given peak"
    return f"% {peak_format(device) or 'data-sheet'} peak"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small CNN on the quick subset, 2 epochs, batch 64: seconds on a CPU")
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="default: resnet18 (small_cnn with --quick)")
    parser.add_argument("--epochs", type=int, default=None, help="default: 10 (2 with --quick)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="default: 256 (64 with --quick)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--device", default=None, help="default: d2lgpu.try_gpu()")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="DataLoader workers of the d2l-style loop (d2l uses 4)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the fast path")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense Tensor Core peak of the device (default: "
                             "d2lgpu.chips.PEAK_TFLOPS: bf16, fp16 on T4/V100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS),
                        help="which loops to run (default: all three)")
    args = parser.parse_args()
    if "d2l-style" not in args.loops:
        parser.error("--loops must include d2l-style: it is the baseline of the comparison")

    model_name = args.model or ("small_cnn" if args.quick else "resnet18")
    epochs = args.epochs or (2 if args.quick else 10)
    batch_size = args.batch_size or (64 if args.quick else 256)
    device = d2lgpu.try_gpu() if args.device is None else torch.device(args.device)
    peak = args.peak_tflops or peak_tflops(device)
    make_model = MODELS[model_name]
    flops_per_image = training_flops_per_example(make_model())

    print(f"{datetime.date.today()} | {machine_name(device)} | torch {torch.__version__}")
    print(f"{model_name}, {'quick subset' if args.quick else 'full Fashion-MNIST'}, "
          f"{epochs} epochs, batch {batch_size}, lr {args.lr}, seed {args.seed}; "
          f"{flops_per_image / 1e9:.4g} GFLOP per training image (FlopCounterMode, fwd+bwd); "
          f"peak {'n/a' if peak is None else f'{peak:g} TFLOP/s'}")

    train_iter, test_iter = d2lgpu.load_data_fashion_mnist(batch_size, quick=args.quick)
    num_examples = len(train_iter.dataset)
    # d2l's own loaders: shuffled, `workers` processes started every epoch, no pinning.
    d2l_train = data.DataLoader(train_iter.dataset, batch_size, shuffle=True,
                                num_workers=args.workers)
    d2l_test = data.DataLoader(test_iter.dataset, batch_size, num_workers=args.workers)

    histories: dict[str, History] = {}
    set_seed(args.seed)
    net = make_model()
    init_weights(net)
    histories["d2l-style"] = train_d2l_style(net, d2l_train, d2l_test, epochs, args.lr, device)

    if "d2lgpu.train" in args.loops:
        histories["d2lgpu.train"] = d2lgpu.train(
            make_model(), train_iter, test_iter, epochs, args.lr, device, seed=args.seed,
            progress=False,
        )

    if "fast" in args.loops:
        fast_train, fast_test = fashion_mnist_on_device(batch_size, device, quick=args.quick)
        fast_name = "train_fast" + (" (compiled)" if args.compile else "")
        histories[fast_name] = train_fast(
            make_model(), fast_train, fast_test, epochs, args.lr, device, seed=args.seed,
            techniques=d2lgpu.Techniques.fast(device, compile=args.compile), progress=False,
        )

    baseline = sum(num_examples / eps for eps in histories["d2l-style"].examples_per_second)
    rows = [
        summarise(name, h, num_examples, flops_per_image, peak,
                  None if name == "d2l-style" else baseline)
        for name, h in histories.items()
    ]
    headers = ["loop", "epoch 1 s", "later s/epoch", "img/s", "total train s",
               "vs d2l", peak_header(device, args.peak_tflops), "test acc"]
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
