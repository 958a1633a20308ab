"""d2lgpu: the helpers of a course on finding, using and filling GPUs with PyTorch.

Each chapter's helpers live in its own modules (README.md, "Where a chapter's helpers
live"); below them ``d2lgpu.runtime`` holds what a learner need not read. The names the
notebooks use are re-exported here; the distributed entry points and the modules of
chapters 8 and 9 are imported by name, to keep ``import d2lgpu`` light.
"""

from d2lgpu.benchmarking import (
    measure_copy_bandwidth,
)
from d2lgpu.chips import (
    native_tensor_core_formats,
    peak_tflops,
    training_flops_per_example,
)
from d2lgpu.data import (
    DeviceLoader,
    fashion_mnist_on_device,
    fashion_mnist_tensors,
    load_data_fashion_mnist,
)
from d2lgpu.devices import cpu, gpu, try_all_gpus, try_gpu
from d2lgpu.fast import Techniques, technique_skip_reason, train_fast
from d2lgpu.models import Residual, resnet18, small_cnn
from d2lgpu.parallel import (
    allreduce,
    data_parallel_step,
    max_abs_difference,
    replicate_params,
    split_batch,
)
from d2lgpu.plotting import plot_lines, plot_precision_sweep
from d2lgpu.precision import (
    PRECISION_MODES,
    PrecisionPolicy,
    amp_sweep_mode,
    compare_sweep_modes,
    format_sweep_table,
    precision_policy,
    precision_sweep,
    random_batch_maker,
    sweep_mlp,
    tf32_matmuls,
)
from d2lgpu.replicas import ReplicasOnOneDevice, compare_across_seeds, scaled_learning_rate
from d2lgpu.report import (
    diagnose_cuda,
    diagnose_this_machine,
    environment_report,
    format_report,
    gpu_memory,
    parse_cuda_visible_devices,
    print_setup,
    read_nvml,
)
from d2lgpu.runtime.config import data_root, pick, quick_mode, smoke_mode, workload
from d2lgpu.runtime.gpus import num_gpus
from d2lgpu.runtime.progress import elapsed_bar
from d2lgpu.timing import tflops, time_fn
from d2lgpu.training import History, train

__version__ = "0.1.0"

__all__ = [
    "elapsed_bar",
    "DeviceLoader",
    "History",
    "PRECISION_MODES",
    "PrecisionPolicy",
    "ReplicasOnOneDevice",
    "Residual",
    "Techniques",
    "allreduce",
    "amp_sweep_mode",
    "compare_across_seeds",
    "compare_sweep_modes",
    "cpu",
    "data_parallel_step",
    "data_root",
    "diagnose_cuda",
    "diagnose_this_machine",
    "environment_report",
    "fashion_mnist_on_device",
    "fashion_mnist_tensors",
    "format_report",
    "format_sweep_table",
    "gpu",
    "gpu_memory",
    "load_data_fashion_mnist",
    "max_abs_difference",
    "measure_copy_bandwidth",
    "native_tensor_core_formats",
    "num_gpus",
    "parse_cuda_visible_devices",
    "peak_tflops",
    "pick",
    "plot_lines",
    "plot_precision_sweep",
    "precision_policy",
    "precision_sweep",
    "print_setup",
    "quick_mode",
    "smoke_mode",
    "random_batch_maker",
    "read_nvml",
    "replicate_params",
    "resnet18",
    "scaled_learning_rate",
    "small_cnn",
    "split_batch",
    "sweep_mlp",
    "technique_skip_reason",
    "tf32_matmuls",
    "tflops",
    "time_fn",
    "train",
    "train_fast",
    "training_flops_per_example",
    "try_all_gpus",
    "try_gpu",
    "workload",
]
