"""d2lgpu: the helpers of a course on finding, using and filling GPUs with PyTorch.

Modules by concern: ``config`` (environment variables), ``devices`` (naming
devices), ``report`` (what this machine can do, and why CUDA is missing),
``precision`` (mixed-precision policy), ``benchmarking`` (timing GPU work
correctly), ``data``, ``models``, ``parallel``, ``training``, ``plotting``,
``distributed``.
"""

from d2lgpu.config import data_root, describe_mode, pick, quick_mode
from d2lgpu.devices import cpu, gpu, num_gpus, try_all_gpus, try_gpu
from d2lgpu.parallel import (
    allreduce,
    data_parallel_step,
    max_abs_difference,
    replicate_params,
    split_batch,
)
from d2lgpu.precision import PrecisionPolicy, native_tensor_core_formats, precision_policy
from d2lgpu.report import (
    EnvironmentReport,
    diagnose_cuda,
    diagnose_this_machine,
    environment_report,
    format_report,
    gpu_memory,
    parse_cuda_visible_devices,
    print_report,
    print_setup,
    read_nvml,
    setup_summary,
)

__version__ = "0.1.0"

__all__ = [
    "EnvironmentReport",
    "PrecisionPolicy",
    "allreduce",
    "cpu",
    "data_parallel_step",
    "data_root",
    "describe_mode",
    "diagnose_cuda",
    "diagnose_this_machine",
    "environment_report",
    "format_report",
    "gpu",
    "gpu_memory",
    "max_abs_difference",
    "native_tensor_core_formats",
    "num_gpus",
    "parse_cuda_visible_devices",
    "pick",
    "precision_policy",
    "print_report",
    "print_setup",
    "quick_mode",
    "read_nvml",
    "replicate_params",
    "setup_summary",
    "split_batch",
    "try_all_gpus",
    "try_gpu",
]
