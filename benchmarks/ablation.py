"""The fast path as an ablation: the same training, one technique added per row.

Starting from a d2l-style loop (DataLoader, ``.item()`` after every step, fp32), each
row switches on one more technique of ``d2lgpu.Techniques`` and trains a fresh model
from the same seed with ``d2lgpu.train_fast``: data on the device, no per-step sync,
mixed precision in the device's fast format (``precision="auto"``), channels-last, a
fused optimizer, ``torch.compile``, CUDA graphs. A technique that does not apply on the device is a
row that says why (``d2lgpu.technique_skip_reason``) and stays off below it.

Printed per row: the median images per second of the epochs after the first (the first
pays one-off costs such as compiling) over ``--repeats`` interleaved runs; "x prev", the
median of the epoch-by-epoch ratios to the row before (what this row's technique did) and
the verdict on it (faster, slower, or the same speed within 10%); "x base", the median over
the baseline's; MFU (the counted matmul and convolution FLOPs per second over the device's
data-sheet peak; n/a on a CPU), first-epoch seconds and final test accuracy. Compiled rows
start from an emptied dynamo cache and compile with fullgraph=True. Chapter 7 runs the same
ablation.

    python benchmarks/ablation.py                 # this machine's workload: full on a GPU
    python benchmarks/ablation.py --workload cpu  # the CPU size: small CNN, 3,200 images
    python benchmarks/ablation.py --quick         # seconds: quick subset, no compile
    python benchmarks/ablation.py --output runs/ablation.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import time
from pathlib import Path

import torch

import d2lgpu
from d2lgpu import profiling
from d2lgpu.chips import peak_tflops, training_flops_per_example


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return (f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads")


def skip_compiled_rows() -> dict[str, str]:
    """The rows ``--skip-compile`` leaves out: torch.compile, and CUDA graphs, which
    ``d2lgpu.compile_model`` also runs through torch.compile ("reduce-overhead" after a
    compile row, the "cudagraphs" backend alone)."""
    return {"compile": "left out (--skip-compile)",
            "cuda_graphs": "left out (--skip-compile: compiled too)"}


def format_ablation_table(
    rows: list[profiling.AblationRow], flops_per_example: float | None = None,
    peak: float | None = None, counted: dict[str, tuple[float, float]] | None = None,
) -> str:
    """``profiling.ablation_numbers`` as a text table of at most 100 characters a line, with
    each row's first-epoch seconds (compiling included) and test accuracy, skipped rows' reasons
    and the ``counted`` rows' counts (``profiling.count_effects``). No verdict: the reader
    draws it."""
    width = max(len(r.label) for r in rows)
    header = (f"{'step':<{width}}  {'x prev':>6}  {'pairs':>9}  {'img/s':>7}  {'x base':>6}  "
              f"{'MFU':>5}  {'epoch1 s':>8}  {'test acc':>8}")
    lines = [header, "-" * len(header)]
    numbers = profiling.ablation_numbers(rows, flops_per_example, peak)
    for r, n in zip(rows, numbers, strict=True):
        if n is None:
            lines.append(f"{r.label:<{width}}  skipped: {r.step.skip_reason}")
            continue
        mfu = "n/a" if n.mfu is None else f"{100 * n.mfu:.1f}%"
        pairs = f"{n.low:.2f}-{n.high:.2f}"
        lines.append(
            f"{r.label:<{width}}  {n.x_prev:>5.2f}x  {pairs:>9}  {n.images_per_second:>7,.0f}  "
            f"{n.x_base:>5.2f}x  {mfu:>5}  {r.first_epoch_seconds:>8.2f}  {r.test_acc:>8.3f}")
    lines.append("x prev: median of the epoch-by-epoch ratios to the row before; pairs: "
                 "their range")
    lines.append("img/s: the baseline's median times the x prev of every row down to this one")
    units = profiling.COUNT_UNITS
    counted = counted or {}
    lines.extend(f"  {r.label}: {units[r.step.technique]} {counted[r.step.technique][0]:.3g} -> "
                 f"{counted[r.step.technique][1]:.3g}, counted" for r in rows
                 if r.step.technique in counted)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("quick", "cpu", "full"), default=None,
                        help="the sizes of d2lgpu.profiling.ablation_settings (default: "
                             "d2lgpu.workload(): full with a GPU, cpu without)")
    parser.add_argument("--quick", action="store_true", help="same as --workload quick")
    parser.add_argument("--epochs", type=int, default=None, help="override the workload's")
    parser.add_argument("--device", default=None, help="default: d2lgpu.try_gpu()")
    parser.add_argument("--skip-compile", action="store_true",
                        help="leave torch.compile and the CUDA-graphs row (compiled too) out")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per row, interleaved (default: the workload's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the printed report to this file")
    args = parser.parse_args()

    chosen = "quick" if args.quick else args.workload
    if chosen == "quick":
        os.environ["D2LGPU_QUICK"] = "1"  # the data helpers read it
    settings = profiling.ablation_settings(chosen)
    if args.epochs is not None:
        settings = dataclasses.replace(settings, num_epochs=args.epochs)
    device = d2lgpu.try_gpu() if args.device is None else torch.device(args.device)
    skip = dict(settings.skip)
    if args.skip_compile:
        skip.update(skip_compiled_rows())
    repeats = settings.repeats if args.repeats is None else args.repeats
    peak = peak_tflops(device)
    flops = training_flops_per_example(settings.make_model())

    lines = [
        f"{datetime.date.today()} | {machine_name(device)} | torch {torch.__version__}",
        f"{settings.describe()}, seed {args.seed}; {flops / 1e9:.4g} GFLOP per training image",
        profiling.mfu_note(device, peak),
    ]
    print("\n".join(lines), flush=True)
    data, resident = profiling.ablation_data(
        settings.batch_size, device, train_size=settings.train_size,
        test_size=settings.test_size, quick=chosen == "quick",
    )
    plan = profiling.ablation_plan(device, skip=skip)
    start = time.perf_counter()

    def report(step: profiling.AblationStep) -> None:
        done = "ran" if step.skip_reason is None else f"skipped: {step.skip_reason}"
        print(f"  {step.label}: {done} ({time.perf_counter() - start:.0f} s so far)", flush=True)

    def train_row(step: profiling.AblationStep) -> d2lgpu.History:
        # a fresh model from the same seed, on the loaders the row's techniques ask for
        loaders = resident if step.techniques.device_data else data
        return d2lgpu.train_fast(settings.make_model(), *loaders, settings.num_epochs,
                                 settings.lr, device, seed=args.seed,
                                 techniques=step.techniques, progress=False)

    rows = profiling.run_ablation(plan, train_row, repeats=repeats, on_run=report)
    # On a CPU the techniques that save what a GPU has are counted as well as timed.
    counted = (profiling.count_effects(plan, settings.make_model, resident[0], settings.lr, device)
               if device.type == "cpu" else {})
    table = format_ablation_table(rows, flops, peak, counted)
    print(table)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("\n".join(lines + [table]) + "\n", encoding="utf-8")
        print(f"written to {args.output}")


if __name__ == "__main__":
    main()
