"""The fast training path: the whole data set on the device, nothing waiting on the host.

:func:`d2lgpu.train` is the loop most learners start from: a CPU ``DataLoader``
decodes and copies every batch, and the GPU waits whenever the host falls behind.
For a data set as small as Fashion-MNIST (47 MB as uint8) that is pure overhead.
The fastest small-image training code (e.g. the CIFAR-10 speed runs) does this
instead, and so does :func:`train_fast`:

* The images live on the device as uint8, four times smaller than float32, and
  are converted and normalised there, one batch at a time (:class:`DeviceLoader`).
* Shuffling is a ``torch.randperm`` on the device from a seeded generator; a batch
  is an index into the resident tensors. No worker processes, no host copies.
* On a GPU the model runs in channels-last layout (NHWC, the layout of cuDNN's
  Tensor Core convolutions) under autocast in the precision the GPU runs fast
  (bf16 from Ampere on, fp16 with loss scaling before; see
  :func:`d2lgpu.precision_policy`), with cuDNN's autotuner on. On a CPU it runs in
  bf16 where the CPU computes bf16 natively, else fp32 (:func:`fast_precision`).
* One fused SGD kernel updates all parameters (``fused=True``); it also takes
  GradScaler's inf check on the device, so fp16 needs no host round trip either.
* Loss and correct counts are summed in device tensors and read once per epoch
  (:func:`d2lgpu.training.train_epoch`), so the host queues work far ahead of the GPU.
* ``torch.compile`` is available behind ``compile=...`` (off by default: compiling
  costs tens of seconds up front and needs a working compiler toolchain).

Everything else is the plain recipe: same model, SGD, cross-entropy, batch size,
learning rate and initialisation under ``seed``, so accuracy is comparable.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from d2lgpu.checks import check_positive_int, check_seed
from d2lgpu.data import fashion_mnist_tensors
from d2lgpu.devices import try_gpu
from d2lgpu.precision import PrecisionPolicy, precision_policy
from d2lgpu.report import require_cuda_device
from d2lgpu.training import (
    History,
    check_hyperparameters,
    init_weights,
    resolve_devices,
    run_epochs,
    set_seed,
    warmup_scheduler,
)

__all__ = [
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "DeviceLoader",
    "cpu_has_native_bf16",
    "fashion_mnist_on_device",
    "fast_precision",
    "make_sgd",
    "peak_tflops",
    "train_fast",
    "training_flops_per_example",
]

#: Mean and standard deviation of the Fashion-MNIST training pixels scaled to [0, 1]
#: (all 60,000 images; computed with ``fashion_mnist_tensors`` in float64).
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530


class DeviceLoader:
    """Batches ``(X, y)`` cut from a data set that lives on ``device``, without a DataLoader.

    ``images`` (uint8 ``[N, C, H, W]``) and ``labels`` (int ``[N]``) are copied to
    ``device`` once, and the images stay uint8 there. Each batch is gathered by index,
    converted to float32 and normalised to ``(x / 255 - mean) / std`` on the device.

    ``shuffle=True`` draws a new ``torch.randperm`` on the device every epoch from a
    generator seeded with ``seed``, so the order is reproducible and never touches
    the host. The last batch is smaller when ``batch_size`` does not divide ``N``;
    ``drop_last=True`` skips it instead (every batch then has the same shape, which
    suits CUDA graphs). ``channels_last=True`` hands out batches in channels-last
    layout (a no-op for one-channel images, whose two layouts coincide).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        mean: float | Sequence[float] = FASHION_MNIST_MEAN,
        std: float | Sequence[float] = FASHION_MNIST_STD,
        channels_last: bool = False,
    ) -> None:
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
            got = (
                f"{images.dtype} of shape {tuple(images.shape)}"
                if isinstance(images, torch.Tensor)
                else type(images).__name__
            )
            raise ValueError(
                f"images must be a uint8 tensor [N, C, H, W], got {got}; "
                "d2lgpu.fashion_mnist_tensors() returns one (add a channel dim with unsqueeze(1))"
            )
        if not isinstance(labels, torch.Tensor) or labels.dim() != 1:
            raise ValueError("labels must be a 1-d tensor of class numbers, one per image")
        if labels.dtype.is_floating_point or labels.dtype == torch.bool:
            raise ValueError(f"labels must be integers, got {labels.dtype}")
        if labels.numel() != images.shape[0]:
            raise ValueError(
                f"{images.shape[0]} images but {labels.numel()} labels: they must match one to one"
            )
        if images.shape[0] == 0:
            raise ValueError("the data set is empty")
        self.batch_size = check_positive_int("batch_size", batch_size)
        channels = images.shape[1]
        mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        for name, given, values in (("mean", mean, mean_t), ("std", std, std_t)):
            if values.numel() not in (1, channels):
                raise ValueError(
                    f"{name} has {values.numel()} values, but the images have {channels} "
                    f"channel{'s' if channels != 1 else ''}: give one value for all channels "
                    "or one per channel"
                )
            if not bool(values.isfinite().all()):
                raise ValueError(f"{name} must be finite numbers, got {given!r}")
        if not bool((std_t > 0).all()):
            raise ValueError(f"std must be positive, got {std!r}")

        # A named GPU ("cuda" -> "cuda:0") compares equal to "cuda:0" elsewhere.
        self.device = try_gpu() if device is None else require_cuda_device(device, "DeviceLoader")
        self.images = images.to(self.device).contiguous()  # stays uint8 on the device
        self.labels = labels.to(self.device, torch.int64)
        # (x / 255 - mean) / std as one multiply and one add per element.
        self._scale = (1.0 / (255.0 * std_t)).reshape(1, -1, 1, 1).to(self.device)
        self._shift = (-mean_t / std_t).reshape(1, -1, 1, 1).to(self.device)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.channels_last = channels_last
        self.generator = torch.Generator(device=self.device)
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        """Restart the shuffling sequence: the next epochs repeat those after the same seed."""
        self.generator.manual_seed(check_seed(seed))

    @property
    def num_examples(self) -> int:
        """Examples per epoch (the dropped partial batch not counted)."""
        n = self.images.shape[0]
        return n - n % self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        """Batches per epoch."""
        n = self.images.shape[0]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def normalize(self, images_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 images on the device -> float32 ``(x / 255 - mean) / std``."""
        X = images_uint8.to(torch.float32).mul_(self._scale).add_(self._shift)
        if self.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        return X

    def epoch_indices(self) -> torch.Tensor:
        """The order of one epoch: a fresh permutation when shuffling, else 0..N-1."""
        n = self.images.shape[0]
        if self.shuffle:
            return torch.randperm(n, device=self.device, generator=self.generator)
        return torch.arange(n, device=self.device)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.epoch_indices()
        # split() only slices the index tensor: no kernel launches, no host sync.
        for idx in order[: self.num_examples].split(self.batch_size):
            yield self.normalize(self.images[idx]), self.labels[idx]

    def __repr__(self) -> str:
        return (
            f"DeviceLoader({self.images.shape[0]} examples {tuple(self.images.shape[1:])} "
            f"on {self.device}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
            f"drop_last={self.drop_last})"
        )


def fashion_mnist_on_device(
    batch_size: int,
    device: torch.device | str | None = None,
    *,
    root: str | Path | None = None,
    quick: bool | None = None,
    seed: int = 0,
    test_batch_size: int | None = None,
) -> tuple[DeviceLoader, DeviceLoader]:
    """Fashion-MNIST train and test sets held on ``device``: shuffled train batches, test in order.

    ``device=None`` means :func:`d2lgpu.try_gpu`. ``quick=None`` follows quick mode
    (the same balanced subset as :func:`d2lgpu.load_data_fashion_mnist`). The test
    loader uses ``test_batch_size`` (None: at least 1024; evaluation keeps no
    activations for backward, so larger batches fit and launch fewer kernels).
    """
    device = try_gpu() if device is None else require_cuda_device(device, "fashion_mnist_on_device")
    if test_batch_size is not None:
        check_positive_int("test_batch_size", test_batch_size)
    # One-channel images are laid out the same either way; channels_last=True keeps the
    # loader right for RGB data sets too.
    channels_last = True
    train_images, train_labels = fashion_mnist_tensors(train=True, root=root, quick=quick)
    test_images, test_labels = fashion_mnist_tensors(train=False, root=root, quick=quick)
    train_loader = DeviceLoader(
        train_images, train_labels, batch_size, device=device, shuffle=True, seed=seed,
        channels_last=channels_last,
    )
    test_loader = DeviceLoader(
        test_images, test_labels,
        max(batch_size, 1024) if test_batch_size is None else test_batch_size, device=device,
        channels_last=channels_last,
    )
    return train_loader, test_loader


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 natively on this CPU (AVX512-BF16 or AMX instructions)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bf16 path
        return False


def fast_precision(
    device: torch.device | str, amp: bool | str | torch.dtype = "auto"
) -> PrecisionPolicy:
    """The precision :func:`train_fast` uses: like :func:`d2lgpu.precision_policy`, except
    that ``"auto"`` on a CPU means bf16 only where the CPU computes bf16 natively.

    Without native bf16 instructions, bf16 autocast on a CPU converts every operand
    back and forth and is slower than fp32. With AVX512-BF16, a ResNet-18 step ran
    about 2.5x faster in bf16 than in fp32 (``benchmarks/RESULTS.md``). On GPUs
    ``"auto"`` is the GPU's fast Tensor Core format. ``amp=False`` forces fp32.
    """
    device = torch.device(device)
    if isinstance(amp, str) and amp.lower() == "auto" and device.type == "cpu":
        return precision_policy(device, "bf16" if cpu_has_native_bf16() else False)
    return precision_policy(device, amp)


def make_sgd(
    params, lr: float, device: torch.device | str, *, momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> torch.optim.SGD:
    """SGD with the fastest step this torch offers on ``device``: fused, else foreach.

    The for-loop implementation launches kernels for each of the model's parameter
    tensors (76 for ResNet-18); ``foreach`` (torch's default on CUDA) groups them into
    a few multi-tensor kernels; ``fused`` does the whole update in one pass and can
    take GradScaler's scale and inf flag as device tensors, so loss scaling needs no
    host round trip. Fused SGD exists on CUDA and CPU in recent torch; where it does
    not, ``foreach`` is used.
    """
    device = torch.device(device)
    kwargs = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
    if "fused" in inspect.signature(torch.optim.SGD).parameters:
        try:
            from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

            fused_devices = _get_fused_kernels_supported_devices()
        except ImportError:  # older torch: fused SGD existed for CUDA only
            fused_devices = ["cuda"]
        if device.type in fused_devices:
            return torch.optim.SGD(params, fused=True, **kwargs)
    return torch.optim.SGD(params, foreach=True, **kwargs)


def _as_device_loader(
    data: object, name: str, device: torch.device, batch_size: int, shuffle: bool, seed: int,
    channels_last: bool,
) -> DeviceLoader:
    if isinstance(data, DeviceLoader):
        if data.device != device:
            raise ValueError(
                f"{name} lives on {data.device} but training runs on {device}: build the "
                f"loader on {device} (e.g. d2lgpu.fashion_mnist_on_device(..., device))"
            )
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(
        isinstance(t, torch.Tensor) for t in data
    ):
        return DeviceLoader(
            data[0], data[1], batch_size, device=device, shuffle=shuffle, seed=seed,
            channels_last=channels_last,
        )
    raise TypeError(
        f"{name} must be a d2lgpu.DeviceLoader or a pair (uint8 images, labels), got "
        f"{type(data).__name__}. The fast path keeps the data set on the device instead of "
        "reading a DataLoader: use d2lgpu.fashion_mnist_on_device(batch_size, device), or "
        "d2lgpu.train(...) without fast=True for a DataLoader."
    )


def _maybe_compile(net: nn.Module, compile: bool | str) -> nn.Module:
    """``torch.compile(net)`` when asked (a string picks the mode), with a clear error
    where this Python/torch has no compiler stack."""
    if compile is False:
        return net
    if not torch._dynamo.is_dynamo_supported():
        raise RuntimeError(
            "torch.compile is not supported with this Python and torch; pass compile=False"
        )
    if compile is True:
        return torch.compile(net)
    if isinstance(compile, str):
        return torch.compile(net, mode=compile)
    raise ValueError(
        f"compile must be False, True or a torch.compile mode such as 'max-autotune', "
        f"got {compile!r}"
    )


def train_fast(
    net: nn.Module,
    train_data: DeviceLoader | tuple[torch.Tensor, torch.Tensor],
    test_data: DeviceLoader | tuple[torch.Tensor, torch.Tensor],
    num_epochs: int,
    lr: float,
    device: torch.device | str | None = None,
    *,
    batch_size: int = 256,
    seed: int | None = 0,
    amp: bool | str | torch.dtype = "auto",
    compile: bool | str = False,
    channels_last: bool | None = None,
    progress: bool = True,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    warmup_epochs: float = 0.0,
    init: bool = True,
) -> History:
    """Train like :func:`d2lgpu.train` on one device, with the data on the device and no
    per-step host synchronisation. Returns the same :class:`d2lgpu.History`.

    ``train_data``/``test_data``: :class:`DeviceLoader` s (e.g. from
    :func:`fashion_mnist_on_device`), or pairs ``(uint8 images, labels)`` that are
    put on the device here and batched with ``batch_size`` (train shuffled). ``seed``
    seeds initialisation and restarts the training loader's shuffling, so a seed
    gives the same run on the CPU (GPU kernels may differ in the last bits).
    ``amp="auto"``: the GPU's fast format; on a CPU bf16 where native, else fp32
    (:func:`fast_precision`).
    ``compile``: False, True, or a ``torch.compile`` mode; the first epoch then
    includes compilation time. ``channels_last`` stores activations as NHWC, the layout
    of cuDNN's Tensor Core convolutions; ``None`` means on CUDA only (on the CPU it did
    not help ResNet-18 in bf16 and slowed the small CNN down: ``benchmarks/RESULTS.md``).
    ``epoch_seconds`` include evaluation, ``examples_per_second`` count training only.
    """
    check_hyperparameters(num_epochs, lr, weight_decay, momentum, warmup_epochs)
    check_positive_int("batch_size", batch_size)
    if not isinstance(compile, (bool, str)):
        raise ValueError(
            f"compile must be False, True or a torch.compile mode such as 'max-autotune', "
            f"got {compile!r}"
        )
    # One device only; resolve_devices names the GPU ("cuda" -> "cuda:0") and gives a
    # clear error for one that is not there.
    devices = [try_gpu()] if device is None else resolve_devices(device)
    if len(devices) != 1:
        raise ValueError(f"train_fast trains on one device, got {[str(d) for d in devices]}")
    device = devices[0]
    if channels_last is None:
        channels_last = device.type == "cuda"
    train_loader = _as_device_loader(
        train_data, "train_data", device, batch_size, True, seed or 0, channels_last
    )
    test_loader = _as_device_loader(
        test_data, "test_data", device, batch_size, False, 0, channels_last
    )
    if seed is not None:
        set_seed(seed)
        train_loader.manual_seed(seed)
    if init:
        init_weights(net)
    net.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    model = _maybe_compile(net, compile)

    policy = fast_precision(device, amp)
    scaler = policy.make_scaler()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = make_sgd(
        net.parameters(), lr, device, momentum=momentum, weight_decay=weight_decay
    )
    scheduler = warmup_scheduler(optimizer, warmup_epochs, len(train_loader))

    history = History(device=str(device))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(train_loader) * num_epochs, unit="batch",
            desc=f"fast path on {device} ({policy.name}, "
            f"{'channels_last' if channels_last else 'NCHW'}, {type(optimizer).__name__} "
            f"{'fused' if optimizer.defaults.get('fused') else 'foreach'}"
            f"{', compiled' if compile is not False else ''})",
        )
    # cuDNN tries its algorithms once per input shape and keeps the fastest; with a
    # fixed batch size (plus one smaller last batch) that pays off from the first epoch.
    benchmark_before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = device.type == "cuda" or benchmark_before
    try:
        run_epochs(
            model, train_loader, test_loader, num_epochs, loss_fn, optimizer, device, policy,
            scaler, scheduler, history, bar,
        )
    finally:
        torch.backends.cudnn.benchmark = benchmark_before
        if bar is not None:
            bar.close()
    return history


def training_flops_per_example(
    net: nn.Module, example_shape: Sequence[int] = (1, 28, 28), batch_size: int = 8
) -> float:
    """FLOPs of one training step (forward and backward) per example, counted by
    ``torch.utils.flop_counter.FlopCounterMode`` on a small batch on the CPU.

    Counts matrix multiplications and convolutions (2 FLOPs per multiply-add), which
    is what Tensor Core peaks are quoted for; elementwise work is left out. The
    model's weights and batch-norm statistics are left unchanged (it runs on a copy).
    """
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    check_positive_int("batch_size", batch_size)
    probe = copy.deepcopy(net).to("cpu", torch.float32).train()
    X = torch.zeros(batch_size, *example_shape)
    with FlopCounterMode(display=False) as counter:
        out = probe(X)
        out.float().sum().backward()
    return counter.get_total_flops() / batch_size


#: Dense (no sparsity) Tensor Core peak in TFLOP/s of the fast reduced-precision format
#: (bf16, or fp16 on GPUs without native bf16: T4, V100) from NVIDIA's data sheets,
#: keyed by (model, form factor) as :func:`_model_and_form_factor` reads them from
#: ``torch.cuda.get_device_name()``; form factor None: the name carries none (the H100
#: SXM reports itself as "NVIDIA H100 80GB HBM3", the H200 SXM as "NVIDIA H200").
#: Each value is (peak, SMs of the full GPU); the SM count is given for the GPUs that
#: MIG can split, to scale the peak of a slice (None: not splittable).
PEAK_TFLOPS: dict[tuple[str, str | None], tuple[float, int | None]] = {
    ("h100", None): (989.0, 132),  # SXM5: 1,979 TFLOPS with sparsity
    ("h100", "sxm5"): (989.0, 132),
    ("h100", "pcie"): (756.0, 114),
    ("h100", "nvl"): (835.0, 132),
    ("h200", None): (989.0, 132),  # SXM
    ("h200", "nvl"): (835.0, 132),
    ("a100", None): (312.0, 108),  # SXM4 and PCIe alike
    ("a100", "sxm"): (312.0, 108),
    ("a100", "sxm4"): (312.0, 108),
    ("a100", "pcie"): (312.0, 108),
    ("a10", None): (125.0, None),
    ("l40s", None): (362.0, None),
    ("l40", None): (181.0, None),
    ("l4", None): (121.0, None),
    ("t4", None): (65.0, None),  # fp16
    ("v100", "sxm2"): (125.0, None),  # fp16
    ("v100", "pcie"): (112.0, None),
    ("v100s", "pcie"): (130.0, None),
}

_FORM_FACTORS = {"sxm", "sxm2", "sxm3", "sxm4", "sxm5", "pcie", "nvl"}


def _model_and_form_factor(name: str) -> tuple[str, str | None] | None:
    """("a100", "sxm4") for "NVIDIA A100-SXM4-40GB": the whole model word after the brand,
    and the first form-factor word. Whole words, so "RTX A1000" is not an A100."""
    words = name.lower().replace("-", " ").replace("_", " ").split()
    while words and words[0] in ("nvidia", "tesla"):
        words = words[1:]
    if not words:
        return None
    form_factor = next((w for w in words[1:] if w in _FORM_FACTORS), None)
    return words[0], form_factor


def peak_tflops(device: torch.device | str) -> float | None:
    """The data-sheet dense Tensor Core peak of ``device``'s GPU (:data:`PEAK_TFLOPS`), or None.

    None means unknown: the CPU, or a GPU that is not in the table (say "unknown peak").
    A MIG slice reports its parent GPU's name but only its own multiprocessors; its
    peak is the parent's scaled by its share of the SMs (a 3g.20gb slice of an A100
    has 42 of 108). A GPU with more SMs than the table's is not the one the data
    sheet describes, so its peak is unknown too.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    device = require_cuda_device(device, "peak_tflops")
    key = _model_and_form_factor(torch.cuda.get_device_name(device))
    if key not in PEAK_TFLOPS:
        return None
    peak, full_sms = PEAK_TFLOPS[key]
    if full_sms is None:
        return peak
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms > full_sms:
        return None
    return peak * sms / full_sms
