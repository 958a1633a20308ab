"""Data for the course: Fashion-MNIST (loaders, whole-set tensors) and synthetic regression.

Fashion-MNIST comes through ``torchvision.datasets.FashionMNIST`` and lives under
:func:`d2lgpu.data_root` (``D2LGPU_DATA`` or the user cache). ``download=True`` is
always passed: torchvision skips the download when the raw files are already there,
so the same call works offline with pre-fetched files and online without them.

Quick mode (``D2LGPU_QUICK=1``) replaces both splits by a small subset with the same
number of images of every class, chosen without randomness (the first images of each
class in file order), so that a quick run is fast, balanced and identical everywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils import data

from d2lgpu.checks import check_positive_int
from d2lgpu.config import DATA_ENV, data_root, quick_mode

__all__ = [
    "FASHION_MNIST_LABELS",
    "QUICK_TEST_SIZE",
    "QUICK_TRAIN_SIZE",
    "default_num_workers",
    "fashion_mnist_tensors",
    "get_fashion_mnist_labels",
    "load_data_fashion_mnist",
    "synthetic_regression",
]

#: Text labels of the ten Fashion-MNIST classes, indexed by class number.
FASHION_MNIST_LABELS: tuple[str, ...] = (
    "t-shirt", "trouser", "pullover", "dress", "coat",
    "sandal", "shirt", "sneaker", "bag", "ankle boot",
)

#: Images in the quick-mode training and test subsets (a multiple of 10: balanced classes).
#: Sized so that ResNet-18 trains one epoch on two CPU cores in about ten seconds.
QUICK_TRAIN_SIZE = 500
QUICK_TEST_SIZE = 200

_NUM_CLASSES = len(FASHION_MNIST_LABELS)


def get_fashion_mnist_labels(labels: torch.Tensor | list[int]) -> list[str]:
    """Text labels for a tensor or list of class numbers."""
    return [FASHION_MNIST_LABELS[int(i)] for i in labels]


def _balanced_indices(targets: torch.Tensor, size: int) -> torch.Tensor:
    """Indices of the first ``size // 10`` examples of every class, in file order.

    Deterministic (no RNG) so that quick runs are the same on every machine.
    """
    per_class = size // _NUM_CLASSES
    chosen = [torch.nonzero(targets == c).flatten()[:per_class] for c in range(_NUM_CLASSES)]
    return torch.sort(torch.cat(chosen)).values


def _fashion_mnist_dataset(train: bool, root: str | Path | None, transform=None):
    """The torchvision dataset, with a clear error when it is neither on disk nor downloadable."""
    import torchvision

    root = Path(root).expanduser() if root is not None else data_root()
    try:
        return torchvision.datasets.FashionMNIST(
            root=str(root), train=train, transform=transform, download=True
        )
    except (OSError, RuntimeError) as err:
        # URLError and HTTPError are OSErrors; torchvision raises RuntimeError after
        # every mirror failed. Either way the user needs to know where we looked.
        raise RuntimeError(
            f"Fashion-MNIST is not under {root / 'FashionMNIST' / 'raw'} and could not be "
            f"downloaded ({type(err).__name__}: {err}). Connect to the internet, or copy the "
            f"four raw files (train-images-idx3-ubyte, ...) there, or set {DATA_ENV} to a "
            "directory that holds FashionMNIST/raw/."
        ) from err


def _usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one (a
    container or ``taskset`` can allow fewer than the machine has), else ``os.cpu_count()``.
    DataLoader warns when asked for more workers than this."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def default_num_workers(quick: bool | None = None) -> int:
    """DataLoader worker processes that suit this machine.

    Quick mode: 0 (a few hundred images load faster in-process than workers start).
    With CUDA: 4 per GPU, at most 8 (small images decode fast; more workers only cost
    memory and start-up time, and each loader keeps its own), so decoding keeps up
    with the GPUs. CPU only: the model already uses every core, so 2 workers, and 0
    on a machine with 2 cores or fewer. Never more than the cores this process may use.
    """
    quick = quick_mode() if quick is None else quick
    cores = _usable_cores()
    if quick:
        return 0
    if torch.cuda.is_available():
        return min(4 * max(1, torch.cuda.device_count()), 8, cores)
    return 0 if cores <= 2 else 2


def load_data_fashion_mnist(
    batch_size: int,
    resize: int | tuple[int, int] | None = None,
    root: str | Path | None = None,
    *,
    num_workers: int | None = None,
    quick: bool | None = None,
) -> tuple[data.DataLoader, data.DataLoader]:
    """Train and test DataLoaders for Fashion-MNIST (float images in [0, 1], shape [B, 1, H, W]).

    ``resize`` scales images up (ResNet chapters in d2l use 96); ``quick=None`` follows
    :func:`d2lgpu.quick_mode`. The training loader shuffles with torch's global RNG,
    so :func:`d2lgpu.set_seed` makes its order reproducible. Memory is pinned only when
    CUDA is available (pinning is useless and warns without it).
    """
    from torchvision import transforms

    check_positive_int("batch_size", batch_size)
    if resize is not None:
        sizes = (resize,) if isinstance(resize, int) else tuple(resize)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(
                f"resize must be a positive int or a pair of them (or None), got {resize!r}"
            )
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 0):
        raise ValueError(f"num_workers must be an int >= 0 or None, got {num_workers!r}")
    quick = quick_mode() if quick is None else quick
    workers = default_num_workers(quick) if num_workers is None else num_workers

    steps: list = [transforms.ToTensor()]
    if resize is not None:
        steps.insert(0, transforms.Resize(resize))
    transform = transforms.Compose(steps)

    train_set = _fashion_mnist_dataset(True, root, transform)
    test_set = _fashion_mnist_dataset(False, root, transform)
    if quick:
        train_set = data.Subset(train_set, _balanced_indices(train_set.targets, QUICK_TRAIN_SIZE))
        test_set = data.Subset(test_set, _balanced_indices(test_set.targets, QUICK_TEST_SIZE))

    common = dict(
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        # Workers that survive between epochs save their start-up time every epoch.
        persistent_workers=workers > 0,
    )
    return (
        data.DataLoader(train_set, shuffle=True, **common),
        data.DataLoader(test_set, shuffle=False, **common),
    )


def fashion_mnist_tensors(
    train: bool = True, root: str | Path | None = None, quick: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole split as tensors: images uint8 [N, 1, 28, 28] and labels int64 [N].

    For code that keeps the data set on the GPU and slices batches itself instead of
    using a DataLoader. Quick mode gives the same balanced subset as the loaders.
    """
    dataset = _fashion_mnist_dataset(train, root)
    images = dataset.data.unsqueeze(1).to(torch.uint8)
    labels = dataset.targets.to(torch.int64)
    if quick_mode() if quick is None else quick:
        idx = _balanced_indices(labels, QUICK_TRAIN_SIZE if train else QUICK_TEST_SIZE)
        images, labels = images[idx], labels[idx]
    return images.contiguous(), labels.contiguous()


def synthetic_regression(
    num_examples: int,
    num_features: int,
    noise: float = 0.01,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear regression problem: ``X`` float32 [N, F] and ``y = X w + b + noise``, [N, 1].

    The weights, bias and noise come from a private generator seeded with ``seed``,
    so the data are the same everywhere and do not disturb torch's global RNG.
    Wrap them with ``torch.utils.data.TensorDataset(X, y)`` for a DataLoader.
    """
    check_positive_int("num_examples", num_examples)
    check_positive_int("num_features", num_features)
    if noise < 0:
        raise ValueError(f"noise is a standard deviation and must be >= 0, got {noise!r}")
    gen = torch.Generator().manual_seed(seed)
    true_w = torch.randn(num_features, 1, generator=gen)
    true_b = torch.randn(1, generator=gen)
    X = torch.randn(num_examples, num_features, generator=gen)
    y = X @ true_w + true_b + noise * torch.randn(num_examples, 1, generator=gen)
    return X, y
