"""One training step in each memory layout and precision: which is fastest on this device?

The fast path (:func:`d2lgpu.train_fast`) picks channels_last and, on GPUs, precision "auto"
(autocast in the Tensor Core format). This script measures the four combinations of
{NCHW, channels_last} x {"fp32", "auto"} for one SGD step (forward, backward, fused
update) of a model on random 28x28 one-channel images, so the choice rests on numbers.
Each row is timed under its precision policy's TF32 setting
(:meth:`d2lgpu.PrecisionPolicy.matmul_precision`): "fp32" is strict fp32, with TF32
off for matmuls *and* cuDNN convolutions, which PyTorch otherwise lets use TF32 on
compute capability 8.0 and newer.

    python benchmarks/step_choices.py                       # ResNet-18, batch 256, GPU if any
    python benchmarks/step_choices.py --batch-size 16 --repeats 6   # a CPU in a minute or two
"""

from __future__ import annotations

import argparse
import datetime

import torch
from torch import nn

import d2lgpu
from d2lgpu.fast import make_sgd
from d2lgpu.timing import format_table, time_fn

MODELS = {"resnet18": d2lgpu.resnet18, "small_cnn": d2lgpu.small_cnn}


def make_step(model: str, batch_size: int, device: torch.device, channels_last: bool,
              precision: str):
    """A closure that runs one training step of a fresh model with the given settings."""
    torch.manual_seed(0)
    net = MODELS[model]().to(device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    X = torch.randn(batch_size, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch_size,), device=device)
    policy = d2lgpu.precision_policy(device, precision)
    scaler = policy.make_scaler()
    optimizer = make_sgd(net.parameters(), 0.01, device)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            loss = loss_fn(net(X), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step, policy


def time_choice(step, policy: d2lgpu.PrecisionPolicy, device: torch.device, repeats: int):
    """Time ``step`` under ``policy``'s TF32 setting (strict fp32 for "fp32"; CUDA only)."""
    with policy.matmul_precision():
        return time_fn(step, device, warmup=2, repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default=None, help="default: d2lgpu.try_gpu()")
    args = parser.parse_args()
    device = d2lgpu.try_gpu() if args.device is None else torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{datetime.date.today()} | {name} | torch {torch.__version__} | "
          f"{args.model}, batch {args.batch_size}, {torch.get_num_threads()} CPU threads")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    rows = []
    for channels_last in (False, True):
        for precision in ("fp32", "auto"):
            step, policy = make_step(args.model, args.batch_size, device, channels_last,
                                     precision)
            timing = time_choice(step, policy, device, args.repeats)
            rows.append(["channels_last" if channels_last else "NCHW", policy.name,
                         f"{timing.median * 1e3:.1f}", f"{timing.min * 1e3:.1f}",
                         f"{args.batch_size / timing.median:.0f}"])
    print(format_table(["layout", "precision", "median ms/step", "min ms/step", "img/s"], rows))


if __name__ == "__main__":
    main()
