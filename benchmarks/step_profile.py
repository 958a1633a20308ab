"""Where one training step of the d2l recipe spends its time on a GPU: kernels against host.

    python benchmarks/step_profile.py [--batch-size 256] [--compile]

ResNet-18 on 28x28 Fashion-MNIST-shaped batches, the fast path's settings (bf16 autocast
where the GPU runs it natively, channels-last, fused SGD, no per-step sync). It prints
the step time (CUDA events over 20 steps), the CUDA kernels one step launches and the
time they keep the GPU busy (the profiler's own device-time table). A step that takes
much longer than its kernels is overhead-bound: the host cannot launch kernels as fast
as the GPU runs them, and CUDA graphs (``--compile``: mode "reduce-overhead") are what
helps. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import d2lgpu


def make_step(net, optimizer, policy):
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(X, y):
        optimizer.zero_grad(set_to_none=True)
        with policy.autocast():
            loss = loss_fn(net(X), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def measure(step, X, y, steps: int = 20, graphs: bool = False) -> float:
    """Milliseconds per step, CUDA events around ``steps`` steps after a warm-up."""
    for _ in range(3):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        step(X, y)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        step(X, y)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def kernels_per_step(step, X, y, steps: int = 5) -> tuple[int, float]:
    """Kernel launches and kernel milliseconds per step, from the profiler's events."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(X, y)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time_total for e in kernels)
    return len(kernels) // steps, busy_us / 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--compile", action="store_true",
                        help="also the step compiled with mode='reduce-overhead' (CUDA graphs)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to profile")
        return
    device = torch.device("cuda")
    policy = d2lgpu.precision_policy(device, "auto")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"precision {policy.name}, channels-last, fused SGD")
    for batch in args.batch_size:
        torch.manual_seed(0)
        net = d2lgpu.resnet18().to(device).to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, fused=True)
        X = torch.randn(batch, 1, 28, 28, device=device).contiguous(
            memory_format=torch.channels_last)
        y = torch.randint(0, 10, (batch,), device=device)
        step = make_step(net, optimizer, policy)
        torch.backends.cudnn.benchmark = True
        ms = measure(step, X, y)
        launches, busy = kernels_per_step(step, X, y)
        print(f"batch {batch:5d} eager: {ms:6.2f} ms/step, {batch / ms * 1e3:8.0f} img/s, "
              f"{launches} kernels/step busy {busy:5.2f} ms ({100 * busy / ms:4.1f}% of the step)",
              flush=True)
        if args.compile:
            torch._dynamo.reset()
            started = time.perf_counter()
            graphed = torch.compile(step, mode="reduce-overhead")
            ms_graph = measure(graphed, X, y, graphs=True)
            print(f"batch {batch:5d} reduce-overhead: {ms_graph:6.2f} ms/step, "
                  f"{batch / ms_graph * 1e3:8.0f} img/s ({ms / ms_graph:.1f}x eager; compile "
                  f"and warm-up {time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
