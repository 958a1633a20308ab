"""d2lgpu: the helpers of a course on finding, using and filling GPUs with PyTorch.

Modules by concern: ``config`` (environment variables), ``devices`` (naming
devices), ``report`` (what this machine can do, and why CUDA is missing),
``benchmarking`` (timing GPU work correctly), ``data`` (Fashion-MNIST),
``models`` (ResNet-18, a small CNN and a residual MLP), ``parallel`` (data
parallelism by hand), ``training`` (the train loop), ``plotting``,
``precision`` (mixed precision), ``fast`` (the device-resident fast path),
``distributed``, ``ddp_train`` and ``healthcheck`` (torch.distributed and
torchrun), ``memory`` (where training memory goes, counted; gradient
accumulation; activation checkpointing), ``sharding`` and ``fsdp_train``
(FSDP2, collectives counted, distributed checkpoints; imported by name, not
re-exported here, to keep ``import d2lgpu`` light), and ``checks`` (argument
checks the others share).
"""

from d2lgpu.benchmarking import (
    Timing,
    benchmark_autorange,
    gbps,
    measure_copy_bandwidth,
    measure_host_to_device,
    tflops,
    time_fn,
    time_naive,
)
from d2lgpu.config import data_root, describe_mode, pick, quick_mode, workload
from d2lgpu.data import (
    FASHION_MNIST_LABELS,
    QUICK_TEST_SIZE,
    QUICK_TRAIN_SIZE,
    fashion_mnist_tensors,
    get_fashion_mnist_labels,
    load_data_fashion_mnist,
    synthetic_regression,
)
from d2lgpu.devices import cpu, gpu, num_gpus, try_all_gpus, try_gpu
from d2lgpu.distributed import (
    choose_backend,
    find_free_port,
    hogwild_train,
    launch,
    process_group,
)
from d2lgpu.fast import (
    DeviceLoader,
    fashion_mnist_on_device,
    peak_tflops,
    train_fast,
    training_flops_per_example,
)
from d2lgpu.memory import (
    Checkpointed,
    LiveTensorBytes,
    MemoryAnatomy,
    SavedActivations,
    accumulated_gradients,
    checkpoint_stages,
    measure_activations,
    measure_training_memory,
)
from d2lgpu.models import MLPBlock, Residual, residual_mlp, resnet18, small_cnn
from d2lgpu.parallel import (
    allreduce,
    data_parallel_step,
    max_abs_difference,
    replicate_params,
    split_batch,
)
from d2lgpu.plotting import LivePlot, plot_history, plot_lines, plot_precision_sweep
from d2lgpu.precision import (
    PRECISION_MODES,
    PrecisionPolicy,
    SweepComparison,
    SweepRow,
    amp_sweep_mode,
    compare_sweep_modes,
    format_sweep_table,
    mode_unavailable_reason,
    native_tensor_core_formats,
    precision_policy,
    precision_sweep,
    random_batch_maker,
    sweep_mlp,
    tf32_matmuls,
)
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
from d2lgpu.training import History, evaluate_accuracy, init_weights, set_seed, train

__version__ = "0.1.0"

__all__ = [
    "Checkpointed",
    "DeviceLoader",
    "EnvironmentReport",
    "FASHION_MNIST_LABELS",
    "History",
    "LivePlot",
    "LiveTensorBytes",
    "MLPBlock",
    "MemoryAnatomy",
    "PRECISION_MODES",
    "PrecisionPolicy",
    "QUICK_TEST_SIZE",
    "QUICK_TRAIN_SIZE",
    "Residual",
    "SavedActivations",
    "SweepComparison",
    "SweepRow",
    "Timing",
    "accumulated_gradients",
    "allreduce",
    "amp_sweep_mode",
    "benchmark_autorange",
    "checkpoint_stages",
    "choose_backend",
    "compare_sweep_modes",
    "cpu",
    "data_parallel_step",
    "data_root",
    "describe_mode",
    "diagnose_cuda",
    "diagnose_this_machine",
    "environment_report",
    "evaluate_accuracy",
    "fashion_mnist_on_device",
    "fashion_mnist_tensors",
    "find_free_port",
    "format_report",
    "format_sweep_table",
    "gbps",
    "get_fashion_mnist_labels",
    "gpu",
    "gpu_memory",
    "hogwild_train",
    "init_weights",
    "launch",
    "load_data_fashion_mnist",
    "max_abs_difference",
    "measure_activations",
    "measure_copy_bandwidth",
    "measure_host_to_device",
    "measure_training_memory",
    "mode_unavailable_reason",
    "native_tensor_core_formats",
    "num_gpus",
    "parse_cuda_visible_devices",
    "peak_tflops",
    "pick",
    "plot_history",
    "plot_lines",
    "plot_precision_sweep",
    "precision_policy",
    "precision_sweep",
    "print_report",
    "print_setup",
    "process_group",
    "quick_mode",
    "workload",
    "random_batch_maker",
    "read_nvml",
    "replicate_params",
    "residual_mlp",
    "resnet18",
    "set_seed",
    "setup_summary",
    "small_cnn",
    "split_batch",
    "sweep_mlp",
    "synthetic_regression",
    "tf32_matmuls",
    "tflops",
    "time_fn",
    "time_naive",
    "train",
    "train_fast",
    "training_flops_per_example",
    "try_all_gpus",
    "try_gpu",
]
