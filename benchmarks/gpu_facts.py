"""Facts the chapters state about CUDA, checked on the GPU at hand: one line per fact.

    python benchmarks/gpu_facts.py

Each probe prints what torch did, not what the text says it does:
- the TF32 switches: mixing ``fp32_precision`` (the new API) with ``allow_tf32`` (the legacy one);
- which host-to-device copies and tensor constructors synchronise the host
  (``torch.cuda.set_sync_debug_mode``), pageable and pinned;
- what dtype a matmul inside a ``torch.autograd.Function``'s forward gets under autocast,
  and in which autocast state its backward runs.
Without CUDA it says so and exits 0, so a CPU rehearsal runs it too.
"""

from __future__ import annotations

import warnings

import torch


def probe(name: str, fn) -> None:
    try:
        print(f"{name}: {fn()}")
    except Exception as error:  # a probe's error is its result
        first = str(error).strip().splitlines()[0][:240] if str(error).strip() else ""
        print(f"{name}: raised {type(error).__name__}: {first}")


def tf32_mix() -> str:
    results = []
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        try:
            legacy = torch.backends.cuda.matmul.allow_tf32
            results.append(f"read allow_tf32 after the new API -> {legacy}")
        except Exception as error:
            results.append(f"read allow_tf32 after the new API raised {str(error)[:160]!r}")
        try:
            torch.backends.cuda.matmul.allow_tf32 = False
            results.append("set allow_tf32 after the new API -> ok")
        except Exception as error:
            results.append(f"set allow_tf32 after the new API raised {str(error)[:160]!r}")
        try:
            results.append(f"torch.get_float32_matmul_precision() -> "
                           f"{torch.get_float32_matmul_precision()}")
        except Exception as error:
            results.append(f"get_float32_matmul_precision raised {str(error)[:160]!r}")
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    return "; ".join(results)


def syncs(make) -> str:
    """How many synchronising calls the sync debug mode reports for ``make()``."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            make()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    hits = [w for w in caught if "synchroniz" in str(w.message).lower()]
    return f"{len(hits)} synchronising call(s)" + (
        f" ({str(hits[0].message).splitlines()[0][:90]})" if hits else "")


class MatmulFn(torch.autograd.Function):
    seen: dict[str, object] = {}

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        out = a @ b
        MatmulFn.seen["forward dtype"] = out.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        MatmulFn.seen["autocast on in backward"] = torch.is_autocast_enabled("cuda")
        a, b = ctx.saved_tensors
        return grad @ b.t(), a.t() @ grad


def autocast_in_function() -> str:
    a = torch.randn(64, 64, device="cuda", requires_grad=True)
    b = torch.randn(64, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = MatmulFn.apply(a, b)
        out.float().sum().backward()  # backward inside the autocast block, as people write it
    return ", ".join(f"{k} {v}" for k, v in MatmulFn.seen.items())


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to probe")
        return
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, capability "
          f"{torch.cuda.get_device_capability(device)}, torch {torch.__version__}")
    torch.ones(1, device=device)  # the context exists before the probes
    probe("TF32 legacy/new mix", tf32_mix)
    pageable, pinned = torch.randn(1 << 20), torch.randn(1 << 20).pin_memory()
    probe("pageable .to(cuda)", lambda: syncs(lambda: pageable.to(device)))
    probe("pageable .to(cuda, non_blocking=True)",
          lambda: syncs(lambda: pageable.to(device, non_blocking=True)))
    probe("pinned .to(cuda, non_blocking=True)",
          lambda: syncs(lambda: pinned.to(device, non_blocking=True)))
    probe("torch.tensor(3.0, device=cuda)", lambda: syncs(lambda: torch.tensor(3.0, device=device)))
    x = torch.randn(1000, device=device)
    probe("loss.item()", lambda: syncs(lambda: x.sum().item()))
    probe("autograd.Function under bf16 autocast", autocast_in_function)


if __name__ == "__main__":
    main()
