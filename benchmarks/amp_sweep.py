"""The precision sweep of chapter 6 as one table: FP32, TF32, fp16 and bf16 across batch sizes.

For a matmul-heavy MLP and for ResNet-18, every mode trains a fresh copy of the
model (same seed) for a few SGD steps at each batch size and reports the median
step time (synchronised), the peak GPU memory and the loss after the steps. With
--repeats N (default 3) every row is measured N times, the modes of one batch size
taking turns, and a row's time is the median of its repeats. A batch that does not
fit is reported as OOM; modes the device cannot run say why. Below the table: at
the largest batch size where both ran, the speed-up of the device's automatic mixed
precision (bf16 from compute capability 8.0, fp16 + GradScaler below; bf16 on a
CPU) over strict FP32, the range of the paired repeats, a verdict from their median
(faster above 1.1x, slower below 1/1.1x, else the same speed; three repeats at least), the
peak-memory saving on a GPU and the saving in bytes saved for the backward pass.

    python benchmarks/amp_sweep.py           # real sizes, for a GPU
    python benchmarks/amp_sweep.py --quick   # tiny sizes, seconds on a CPU
"""

from __future__ import annotations

import argparse

import torch

import d2lgpu


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny models and batches, for a CPU-only check")
    parser.add_argument("--device", default=None,
                        help="device to measure (default: the first GPU, else the CPU)")
    parser.add_argument("--models", nargs="+", choices=["mlp", "resnet18"],
                        default=["mlp", "resnet18"], help="which models to sweep")
    parser.add_argument("--modes", nargs="+", choices=list(d2lgpu.PRECISION_MODES),
                        default=list(d2lgpu.PRECISION_MODES), help="precision modes to compare")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per row")
    parser.add_argument("--largest", action="store_true",
                        help="only the largest batch size of each model's sweep")
    parser.add_argument("--repeats", type=int, default=None,
                        help="measurements per row, modes interleaved (default 3; quick: 1)")
    args = parser.parse_args()
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    if "fp32" not in args.modes:
        parser.error("--modes must include fp32: it is the baseline of the comparison")
    return args


def main() -> None:
    args = parse_args()
    quick = args.quick or d2lgpu.quick_mode()  # D2LGPU_QUICK=1 also selects the tiny sizes

    def pick(full, small):
        return small if quick else full

    device = torch.device(args.device) if args.device else d2lgpu.try_gpu()
    steps = args.steps if args.steps is not None else pick(10, 2)
    warmup = args.warmup if args.warmup is not None else pick(3, 1)
    repeats = args.repeats if args.repeats is not None else pick(3, 1)

    # The same sizes as notebooks/06_mixed_precision.ipynb in full and quick mode.
    width, depth = pick(4096, 64), pick(8, 2)
    image = pick(96, 16)
    sweeps = {
        "mlp": (
            f"MLP {depth}x{width}",
            lambda: d2lgpu.sweep_mlp(28 * 28, width, depth),
            d2lgpu.random_batch_maker((1, 28, 28)),
            pick([256, 1024, 4096, 16384, 65536], [16, 64]),
        ),
        "resnet18": (
            f"ResNet-18 {image}px",
            d2lgpu.resnet18,
            d2lgpu.random_batch_maker((1, image, image)),
            pick([32, 128, 512, 1024, 2048], [8]),
        ),
    }

    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    sizes = "quick" if quick else "full"
    print(f"torch {torch.__version__}; device {device}{name}; {sizes} sizes; "
          f"{repeats} x ({warmup} warm-up + {steps} timed steps) per row\n")
    results = {}
    for key in args.models:
        label, model_fn, make_batch, batch_sizes = sweeps[key]
        if args.largest:
            batch_sizes = batch_sizes[-1:]
        results[label] = d2lgpu.precision_sweep(
            model_fn, make_batch, args.modes, batch_sizes, device, steps=steps, warmup=warmup,
            repeats=repeats,
        )

    label_width = max(len(label) for label in results)
    for i, (label, rows) in enumerate(results.items()):
        header, *lines = d2lgpu.format_sweep_table(rows).splitlines()
        if i == 0:
            print(f"{'model':<{label_width}}  {header}")
        for line in lines:
            print(f"{label:<{label_width}}  {line}")

    amp_mode = d2lgpu.amp_sweep_mode(device)
    print()
    for label, rows in results.items():
        for candidate in dict.fromkeys([amp_mode, "tf32"]):
            if candidate not in args.modes:
                continue
            comparison = d2lgpu.compare_sweep_modes(rows, "fp32", candidate)
            if comparison is None:
                print(f"{label}: {candidate} did not run next to fp32 on {device}")
            else:
                ratio = comparison.paired_speedup  # median of fp32's time over the candidate's
                verdict = ("too few repeats for a verdict" if len(comparison.repeat_speedups) < 3
                           else "faster" if ratio > 1.1
                           else "slower" if ratio < 1 / 1.1 else "the same speed, within 10%")
                print(f"{label}: {comparison.describe()}; median of the pairs {ratio:.2f}x: "
                      f"{verdict}")


if __name__ == "__main__":
    main()
