"""d2lgpu: the helpers of a course on finding, using and filling GPUs with PyTorch.

A chapter's helpers live in its own modules:

1. ``report`` (what this machine has, and why CUDA is missing) and ``chips``
   (what a chip can do: Tensor Core formats, data sheets, peaks, FLOP counts);
2. ``devices`` (naming and resolving devices), ``timing`` (the course's clock:
   ``time_fn``, ``Timing``, rates, ``format_table``) and ``benchmarking`` (the
   wrong timer, bandwidths, the multiply-add study);
3. ``parallel`` (data parallelism by hand);
4. ``data`` (Fashion-MNIST: loaders, tensors, ``DeviceLoader`` on the device),
   ``models``, ``training`` (the train loop), ``replicas`` (DataParallel's arithmetic
   on one device, the lr for k devices) and ``fast`` (the fast path's switches, chapter 7);
5. ``distributed``, ``ddp_train`` and ``healthcheck`` (torch.distributed, torchrun);
6. ``precision`` (the precision vocabulary and policy, the sweep);
7. ``profiling`` (traces, the roofline, the ablation, torch.compile, CUDA graphs);
8. ``memory``, ``sharding`` and ``fsdp_train`` (where memory goes; FSDP2,
   collectives counted, distributed checkpoints);
9. ``model_parallel`` and ``model_parallel_train`` (pipelines, tensor parallel).

Every chapter uses ``config`` (the workload), ``estimate`` (the chapter clock),
``plotting`` and ``checks`` (argument checks that name the fix). A helper that a
second chapter needs moves down to a shared module (``devices``, ``chips``,
``timing``, ``data``, ``models``), never sideways. The names the notebooks use
are re-exported here; the distributed entry points and ``sharding``,
``fsdp_train``, ``model_parallel`` and ``model_parallel_train`` are imported by name, to keep
``import d2lgpu`` light.
"""

from d2lgpu.benchmarking import (
    benchmark_autorange,
    measure_copy_bandwidth,
    measure_host_to_device,
    time_naive,
)
from d2lgpu.chips import (
    native_tensor_core_formats,
    peak_tflops,
    training_flops_per_example,
)
from d2lgpu.config import data_root, describe_mode, pick, quick_mode, smoke_mode, workload
from d2lgpu.data import (
    FASHION_MNIST_LABELS,
    QUICK_TEST_SIZE,
    QUICK_TRAIN_SIZE,
    DeviceLoader,
    fashion_mnist_on_device,
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
from d2lgpu.estimate import ChapterClock, start_chapter
from d2lgpu.fast import Techniques, technique_skip_reason
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
    cpu_has_native_bf16,
    format_sweep_table,
    mode_unavailable_reason,
    precision_policy,
    precision_sweep,
    random_batch_maker,
    sweep_mlp,
    tf32_matmuls,
)
from d2lgpu.profiling import (
    Roofline,
    RooflinePoint,
    ablation_plan,
    capture_training_step,
    explain_graph_breaks,
    format_ablation_table,
    measure_roofline,
    memory_timeline_from_snapshot,
    memory_timeline_from_trace,
    op_table,
    plot_memory_timeline,
    plot_roofline,
    plot_timeline,
    profiler_activities,
    read_trace,
    run_ablation,
    summarize_trace,
)
from d2lgpu.replicas import (
    ReplicasOnOneDevice,
    compare_across_seeds,
    scaled_learning_rate,
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
from d2lgpu.timing import Timing, gbps, tflops, time_fn
from d2lgpu.training import (
    History,
    SGDRecipe,
    evaluate_accuracy,
    init_weights,
    set_seed,
    train,
    train_fast,
)

__version__ = "0.1.0"

__all__ = [
    "ChapterClock",
    "start_chapter",
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
    "ReplicasOnOneDevice",
    "Residual",
    "SGDRecipe",
    "Roofline",
    "RooflinePoint",
    "SavedActivations",
    "SweepComparison",
    "SweepRow",
    "Techniques",
    "Timing",
    "ablation_plan",
    "accumulated_gradients",
    "allreduce",
    "amp_sweep_mode",
    "benchmark_autorange",
    "capture_training_step",
    "checkpoint_stages",
    "choose_backend",
    "compare_across_seeds",
    "compare_sweep_modes",
    "cpu",
    "cpu_has_native_bf16",
    "data_parallel_step",
    "data_root",
    "describe_mode",
    "diagnose_cuda",
    "diagnose_this_machine",
    "environment_report",
    "evaluate_accuracy",
    "explain_graph_breaks",
    "fashion_mnist_on_device",
    "fashion_mnist_tensors",
    "find_free_port",
    "format_ablation_table",
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
    "measure_roofline",
    "measure_training_memory",
    "memory_timeline_from_snapshot",
    "memory_timeline_from_trace",
    "mode_unavailable_reason",
    "native_tensor_core_formats",
    "num_gpus",
    "op_table",
    "parse_cuda_visible_devices",
    "peak_tflops",
    "pick",
    "plot_history",
    "plot_lines",
    "plot_memory_timeline",
    "plot_precision_sweep",
    "plot_roofline",
    "plot_timeline",
    "precision_policy",
    "precision_sweep",
    "print_report",
    "print_setup",
    "process_group",
    "profiler_activities",
    "quick_mode",
    "smoke_mode",
    "random_batch_maker",
    "read_nvml",
    "read_trace",
    "replicate_params",
    "residual_mlp",
    "resnet18",
    "scaled_learning_rate",
    "run_ablation",
    "set_seed",
    "setup_summary",
    "small_cnn",
    "split_batch",
    "summarize_trace",
    "sweep_mlp",
    "synthetic_regression",
    "technique_skip_reason",
    "tf32_matmuls",
    "tflops",
    "time_fn",
    "time_naive",
    "train",
    "train_fast",
    "training_flops_per_example",
    "try_all_gpus",
    "try_gpu",
    "workload",
]
