"""The multiply-add benchmark of chapter 2 as one table: CPU against every GPU here.

Each row times ``steps`` steps of ``result = result + a * b`` (unfused: 6
tensor-sized reads and writes per step) or ``result.addcmul_(a, b)`` (fused:
4) on float32 tensors, synchronised, and reports the achieved bandwidth as a
share of the device's own measured copy bandwidth.

    python benchmarks/elementwise_bandwidth.py            # sizes for a real GPU
    python benchmarks/elementwise_bandwidth.py --quick    # seconds on a laptop CPU
    python benchmarks/elementwise_bandwidth.py --compile  # add a torch.compile variant
"""

from __future__ import annotations

import argparse

import torch

import d2lgpu
from d2lgpu import benchmarking as bm
from d2lgpu import timing


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU-only check")
    parser.add_argument("--steps", type=int, default=None, help="multiply-add steps per loop")
    parser.add_argument("--max-log2", type=int, default=None, help="largest size is 2**this")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per point")
    parser.add_argument("--compile", action="store_true", help="add a torch.compile variant")
    parser.add_argument("--no-cpu", action="store_true", help="skip the (slow) CPU baseline")
    args = parser.parse_args()
    for name in ("steps", "max_log2", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def main() -> None:
    args = parse_args()
    steps = args.steps or (5 if args.quick else 20)
    repeats = args.repeats or (3 if args.quick else 5)
    max_log2 = args.max_log2 or (18 if args.quick else 26)
    sizes = [2**k for k in range(10, max_log2 + 1, 2)]

    gpus = [d for d in d2lgpu.try_all_gpus() if d.type == "cuda"]
    devices = gpus if args.no_cpu and gpus else [torch.device("cpu"), *gpus]
    copy_gbps = {str(d): bm.measure_copy_bandwidth(d) for d in devices}

    variants = dict(bm.MULTIPLY_ADD_VARIANTS)
    if args.compile:
        # compile_on_devices resets dynamo before each device: dynamo keeps one graph per
        # device and stops at its recompile limit (8), which the CPU and 8 GPUs pass.
        compiled, reasons = bm.compile_on_devices(bm.multiply_add_unfused, devices)
        print("\n".join(reasons))
        if compiled is not None:
            # One compiled object serves every device: multiply_add_sweep resets dynamo before
            # each device as well, and compile_or_reason's fullgraph=True turns any fallback
            # to eager into an error.
            variants["compiled"] = (compiled, bm.FUSED_TENSOR_PASSES)

    names = ", ".join(str(d) for d in devices)
    print(f"torch {torch.__version__}; devices: {names}; CPU threads: {torch.get_num_threads()}")
    print(f"{steps} steps per loop, median of {repeats} runs, float32")
    print(
        "copy bandwidth (read + write): "
        + ", ".join(f"{d} {g:.1f} GB/s" for d, g in copy_gbps.items())
    )
    rows = bm.multiply_add_sweep(
        devices, sizes, steps=steps, copy_gbps=copy_gbps, variants=variants, repeats=repeats
    )
    print(timing.format_table(bm.MULTIPLY_ADD_HEADERS, bm.multiply_add_table(rows)))


if __name__ == "__main__":
    main()
