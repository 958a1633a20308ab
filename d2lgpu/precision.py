"""Which reduced precision a device really runs fast, and how to use it.

Tensor Cores run fp16 from compute capability 7.0 (Volta, Turing) and bf16
and tf32 from 8.0 (Ampere, Ada, Hopper). ``torch.cuda.is_bf16_supported()``
is not enough to decide: on a 7.x GPU such as Kaggle's T4 it can say True
because bf16 is *emulated*, which is correct but slow. The policy here goes
by compute capability instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

__all__ = ["PrecisionPolicy", "native_tensor_core_formats", "precision_policy"]


def native_tensor_core_formats(capability: tuple[int, int]) -> list[str]:
    """Reduced-precision formats that GPUs of this compute capability run on Tensor Cores."""
    major, minor = capability
    formats = []
    if (major, minor) >= (7, 0):
        formats.append("fp16")
    if (major, minor) >= (8, 0):
        formats += ["bf16", "tf32"]
    return formats


@dataclass(frozen=True)
class PrecisionPolicy:
    """How to run a training step: autocast dtype (None: plain fp32) and loss scaling."""

    device_type: str
    dtype: torch.dtype | None
    use_scaler: bool

    @property
    def name(self) -> str:
        names = {torch.float16: "fp16", torch.bfloat16: "bf16"}
        if self.dtype is None:
            return "fp32"
        return names[self.dtype] + (" + GradScaler" if self.use_scaler else "")

    def autocast(self) -> ContextManager:
        """``torch.autocast`` for this policy, or a context that does nothing for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def make_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only when this policy needs loss scaling (fp16)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.use_scaler)


_ALIASES = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}


def precision_policy(
    device: torch.device | str,
    amp: bool | str | torch.dtype | None = "auto",
    capability: tuple[int, int] | None = None,
) -> PrecisionPolicy:
    """Choose the precision for training on ``device``.

    ``amp`` is False/None/"off"/"fp32" for plain fp32; "fp16"/"bf16" (or the
    dtype) to force one; True/"auto" to let the device decide: bf16 from
    compute capability 8.0, fp16 with a GradScaler below it, bf16 on the CPU.
    ``capability`` overrides the one read from the device (for tests).
    """
    device = torch.device(device)
    if amp is None or amp is False or (isinstance(amp, str) and amp.lower() in {"off", "fp32"}):
        return PrecisionPolicy(device.type, None, False)
    if amp is True or (isinstance(amp, str) and amp.lower() == "auto"):
        if device.type == "cuda":
            if capability is None:
                capability = torch.cuda.get_device_capability(device)
            dtype = torch.bfloat16 if "bf16" in native_tensor_core_formats(capability) else torch.float16
        else:
            dtype = torch.bfloat16
    elif isinstance(amp, torch.dtype):
        dtype = amp
    elif isinstance(amp, str) and amp.lower() in _ALIASES:
        dtype = _ALIASES[amp.lower()]
    else:
        raise ValueError(
            f"amp={amp!r} is not understood: use False or 'fp32', True or 'auto', 'fp16' or 'bf16'"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"autocast runs in torch.float16 or torch.bfloat16, not {dtype}")
    # fp16 has a narrow range: small gradients underflow to zero without loss scaling.
    return PrecisionPolicy(device.type, dtype, use_scaler=dtype == torch.float16)
