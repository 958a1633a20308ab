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
5. ``ddp_demos``, ``ddp_train`` and ``healthcheck`` (torch.distributed, torchrun);
6. ``precision`` (the precision vocabulary and policy, the sweep);
7. ``profiling`` (traces, the roofline, the ablation, torch.compile, CUDA graphs);
8. ``memory``, ``sharding`` and ``fsdp_train`` (where memory goes; FSDP2,
   collectives counted, distributed checkpoints);
9. ``model_parallel`` and ``model_parallel_train`` (pipelines, tensor parallel).

Every chapter uses ``plotting``. Below the lesson modules sits ``d2lgpu.runtime``, the
machinery a learner need not read: ``checks`` (argument checks that name the fix),
``config`` (the workload), ``gpus`` (what CUDA can use here), ``distributed`` (process
groups, the launcher, fault reports) and ``progress`` (the elapsed-time bar). A helper that a
second chapter needs moves down to a shared module (``devices``, ``chips``,
``timing``, ``data``, ``models``), never sideways. The names the notebooks use
are re-exported here; the distributed entry points and ``sharding``,
``fsdp_train``, ``model_parallel`` and ``model_parallel_train`` are imported by name, to keep
``import d2lgpu`` light.
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
from d2lgpu.replicas import (
    ReplicasOnOneDevice,
    compare_across_seeds,
    scaled_learning_rate,
)
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
from d2lgpu.training import History, set_seed, train

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
    "set_seed",
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
