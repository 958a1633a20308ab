"""What this machine offers, and why CUDA is missing when it is."""

from __future__ import annotations

import torch

from d2lgpu.config import describe_mode
from d2lgpu.devices import num_gpus, try_all_gpus

__all__ = ["print_setup", "setup_summary"]


def setup_summary() -> str:
    """A few lines for the top of every notebook: versions, devices, mode."""
    import d2lgpu

    devices = ", ".join(str(d) for d in try_all_gpus())
    gpus = num_gpus()
    names = (
        " (" + ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) + ")" if gpus else ""
    )
    return "\n".join(
        [
            f"d2lgpu {d2lgpu.__version__}, torch {torch.__version__}",
            f"GPUs: {gpus}{names}; try_all_gpus() -> [{devices}]",
            describe_mode(),
        ]
    )


def print_setup() -> None:
    """Print :func:`setup_summary`."""
    print(setup_summary())
