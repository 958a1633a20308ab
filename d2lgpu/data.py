"""Data for the course: Fashion-MNIST (loaders, whole-set tensors, on the device) and synthetic
regression.

Fashion-MNIST comes through ``torchvision.datasets.FashionMNIST`` and lives under
:func:`d2lgpu.data_root` (``D2LGPU_DATA`` or the user cache). ``download=True`` is
always passed: torchvision skips the download when the raw files are already there,
so the same call works offline with pre-fetched files and online without them.

The four raw files are checked before they are read: their size (a truncated download
says so) and, once per file, their MD5 against the official files; a stamp in the user
cache (never next to the data, which may be read-only or shared) records a file that
passed, keyed by its path, size, modification time, inode and status-change time
(``ctime``, which the system sets on every write and no program can set back, so a
file rewritten in place with its old modification time restored is hashed again).
Hashing all four takes about a third of a second on a 2-core machine. A file that
is another of the four under the wrong name is named as such.

A data set as small as Fashion-MNIST (47 MB as uint8) can live on the GPU whole:
:class:`DeviceLoader` cuts normalised batches from it there, without a DataLoader, a
worker process or a host copy, and :func:`fashion_mnist_on_device` builds the train
and test loaders (the fast path's ``device_data`` technique, chapter 4).

Quick mode (``D2LGPU_QUICK=1``) replaces both splits by a small subset with the same
number of images of every class, chosen without randomness (the first images of each
class in file order), so that a quick run is fast, balanced and identical everywhere.
"""

from __future__ import annotations

import hashlib
import math
import operator
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils import data

from d2lgpu.devices import try_gpu
from d2lgpu.runtime.checks import (
    check_bool,
    check_positive_int,
    check_seed,
    check_writable_path,
)
from d2lgpu.runtime.config import (
    DATA_ENV,
    data_root,
    default_cache_dir,
    quick_mode,
    small_data,
    smoke_mode,
)
from d2lgpu.runtime.gpus import num_gpus, require_cuda_device

__all__ = [
    "FASHION_MNIST_FILES",
    "FASHION_MNIST_LABELS",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "DeviceLoader",
    "QUICK_TEST_SIZE",
    "QUICK_TRAIN_SIZE",
    "TINY_SHAKESPEARE_SHA256",
    "TINY_SHAKESPEARE_URL",
    "default_num_workers",
    "fashion_mnist_on_device",
    "fashion_mnist_tensors",
    "get_fashion_mnist_labels",
    "load_data_fashion_mnist",
    "synthetic_regression",
    "tiny_shakespeare",
    "verify_fashion_mnist_file",
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
#: Smoke mode (``D2LGPU_SMOKE=1``) trains full mode's models on fewer: the chapters'
#: cells need at least 200 of each split (chapter 3 takes 5 batches of 40 from it).
SMOKE_TRAIN_SIZE = 200
SMOKE_TEST_SIZE = 200


def _subset_size(train: bool) -> int:
    """Images in the small subset: smoke mode's, else quick mode's."""
    if smoke_mode():
        return SMOKE_TRAIN_SIZE if train else SMOKE_TEST_SIZE
    return QUICK_TRAIN_SIZE if train else QUICK_TEST_SIZE

_NUM_CLASSES = len(FASHION_MNIST_LABELS)

#: The four raw Fashion-MNIST files: (size in bytes, MD5 of the file). These are the
#: official files unpacked (torchvision checks the MD5s of the .gz files when it downloads).
FASHION_MNIST_FILES: dict[str, tuple[int, str]] = {
    "train-images-idx3-ubyte": (47_040_016, "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
    "train-labels-idx1-ubyte": (60_008, "9018921c3c673c538a1fc5bad174d6f9"),
    "t10k-images-idx3-ubyte": (7_840_016, "8181f5470baa50b63fa0f6fddb340f0a"),
    "t10k-labels-idx1-ubyte": (10_008, "15d484375f8d13e6eb1aabb0c3f46965"),
}


def get_fashion_mnist_labels(labels: torch.Tensor | list[int] | int) -> list[str]:
    """Text labels for class numbers 0 to 9: a tensor of integers, a list of ints, or one int."""
    if isinstance(labels, torch.Tensor):
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise TypeError(f"labels must be integer class numbers, got a {labels.dtype} tensor")
        numbers = labels.reshape(-1).tolist()
    elif isinstance(labels, (str, bytes)):
        raise TypeError(
            f"labels must be class numbers, not the string {labels!r}: pass ints, e.g. [1, 2]"
        )
    elif labels is None or not (isinstance(labels, int) or hasattr(labels, "__iter__")):
        raise TypeError(
            f"labels must be class numbers (an int, a list of ints or an integer tensor), "
            f"got {type(labels).__name__} {labels!r}"
        )
    else:
        items = [labels] if isinstance(labels, int) else list(labels)
        numbers = []
        for item in items:
            if isinstance(item, bool):
                raise TypeError(f"labels must be int class numbers, got bool {item!r}")
            try:
                numbers.append(operator.index(item))
            except TypeError:
                raise TypeError(
                    f"labels must be int class numbers, got {type(item).__name__} {item!r}"
                ) from None
    wrong = [n for n in numbers if not 0 <= n < _NUM_CLASSES]
    if wrong:
        raise ValueError(f"labels are class numbers from 0 to 9, got {wrong[:5]}")
    return [FASHION_MNIST_LABELS[n] for n in numbers]


def _balanced_indices(targets: torch.Tensor, size: int) -> torch.Tensor:
    """Indices of the first ``size // 10`` examples of every class, in file order.

    Deterministic (no RNG) so that quick runs are the same on every machine.
    """
    per_class = size // _NUM_CLASSES
    chosen = [torch.nonzero(targets == c).flatten()[:per_class] for c in range(_NUM_CLASSES)]
    return torch.sort(torch.cat(chosen)).values


def _stamp_dir() -> Path:
    """Where the stamps of files that passed their MD5 check are kept."""
    return default_cache_dir() / "verified"


def _md5_of_file(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as file:
        while chunk := file.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def _looks_like(path: Path, stat_size: int, md5: str | None = None) -> str | None:
    """The name of the official file that ``path`` is (by size, then MD5), other than its own."""
    for name, (size, official) in FASHION_MNIST_FILES.items():
        if name != path.name and size == stat_size:
            if (md5 or _md5_of_file(path)) == official:
                return name
    return None


def _misnamed(path: Path, other: str, fix: str) -> RuntimeError:
    return RuntimeError(
        f"{path} is not {path.name}: it is the official {other} (same size and MD5) "
        f"under the wrong name. Put the right file there. {fix}"
    )


def _stamp_key(path: Path, stat: os.stat_result, md5: str) -> str:
    """What a stamp vouches for: the file's identity and every time the system keeps.

    ``st_ctime_ns`` changes on every write and cannot be set back by ``os.utime``
    (which only sets access and modification times), and ``st_ino`` changes when a
    file is replaced by a copy, so content changed behind a restored mtime shows."""
    return (f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|"
            f"{stat.st_dev}:{stat.st_ino}|{md5}")


def verify_fashion_mnist_file(path: str | Path) -> None:
    """Check one raw Fashion-MNIST file's size, and once its MD5; a clear error if it is off.

    After a file passed, a stamp named after its resolved path, size, modification and
    status-change times, inode and expected MD5 is kept in the user cache, so it is
    not hashed again until it changes. A file that is one of the other three official
    files under this one's name is reported as that file.
    """
    if path is None or isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a path to a raw Fashion-MNIST file, got {path!r}")
    path = Path(path)
    if path.name not in FASHION_MNIST_FILES:
        raise ValueError(
            f"{path.name!r} is not one of the raw Fashion-MNIST files "
            f"({', '.join(FASHION_MNIST_FILES)}): pass the path of one of them"
        )
    size, md5 = FASHION_MNIST_FILES[path.name]
    fix = (
        "Delete it and run again to download it afresh, or copy the official file there "
        "(https://github.com/zalandoresearch/fashion-mnist, unpacked)."
    )
    # What stands at the path must be a regular file before its size means anything: a
    # directory's size is its block (4096), which would read as a truncated download.
    if path.is_dir():
        raise RuntimeError(
            f"{path} is a directory, not the raw file {path.name} ({size} bytes): remove the "
            f"directory and put the file there, or run again to download it"
        )
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist{' (a broken symbolic link)' if path.is_symlink() else ''}: "
            f"run again to download it, or copy the official file there"
        )
    if not path.is_file():
        raise RuntimeError(
            f"{path} is not a regular file (a device, socket or pipe): put the raw file "
            f"{path.name} ({size} bytes) there, or run again to download it"
        )
    stat = path.stat()
    if stat.st_size == 0:
        raise RuntimeError(f"{path} is empty (0 of {size} bytes). {fix}")
    if stat.st_size != size and (other := _looks_like(path, stat.st_size)) is not None:
        raise _misnamed(path, other, fix)
    if stat.st_size < size:
        raise RuntimeError(
            f"{path} is truncated ({stat.st_size} of {size} bytes): an interrupted download "
            f"or copy. {fix}"
        )
    if stat.st_size > size:
        raise RuntimeError(
            f"{path} is corrupt: it has {stat.st_size} bytes, the official file {size}. {fix}"
        )
    key = _stamp_key(path, stat, md5)
    stamp = _stamp_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]
    if stamp.exists():
        return
    actual = _md5_of_file(path)
    if actual != md5 and (other := _looks_like(path, stat.st_size, actual)) is not None:
        raise _misnamed(path, other, fix)
    if actual != md5:
        raise RuntimeError(
            f"{path} is corrupt: its MD5 is {actual}, the official file's is {md5} (the size "
            f"is right, the content is not). {fix}"
        )
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(key + "\n")
    except OSError:  # a read-only cache only means hashing again next time
        pass


def _check_writable(raw: Path, missing: list[str]) -> None:
    """Before a download: fail with the real cause when ``raw`` cannot be written."""
    try:
        check_writable_path("the data directory", raw, kind="directory")
    except (ValueError, PermissionError) as err:
        raise RuntimeError(
            f"Fashion-MNIST is not under {raw} (missing: {', '.join(missing)}), and it cannot "
            f"be downloaded there: {err}. Set {DATA_ENV} (or pass root=) to a writable "
            "directory, or copy the four raw files (train-images-idx3-ubyte, ...) into "
            f"{raw}."
        ) from None
    existing = raw
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        raise RuntimeError(
            f"Fashion-MNIST is not under {raw} (missing: {', '.join(missing)}), and it cannot "
            f"be downloaded there: {existing} is not writable. Set {DATA_ENV} to a writable "
            "directory (the files are downloaded there on first use), or copy the four raw "
            f"files (train-images-idx3-ubyte, ...) into {raw}."
        )


def _read_idx(path: Path) -> torch.Tensor:
    """An unsigned-byte IDX file (the raw MNIST format) as a uint8 tensor of its shape."""
    buffer = bytearray(path.stat().st_size)
    with open(path, "rb") as f:
        f.readinto(buffer)
    ndim = buffer[3]
    header = 4 + 4 * ndim
    shape = [int.from_bytes(buffer[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if buffer[:3] != b"\x00\x00\x08" or len(buffer) != header + math.prod(shape):
        raise RuntimeError(f"{path} is not an unsigned-byte IDX file of the size its header says")
    return torch.frombuffer(buffer, dtype=torch.uint8, offset=header).view(shape)


def _fashion_mnist_dataset(train: bool, root: str | Path | None, transform=None, *,
                           tensors: bool = False):
    """The torchvision dataset from checked files, with a clear error when they are
    missing and cannot be downloaded, or damaged. ``tensors=True``: the split's
    (images [N, 28, 28], labels [N]) instead, read from the checked raw files without
    importing torchvision, which costs a child process seconds."""
    if root is not None and (isinstance(root, bool) or not isinstance(root, (str, os.PathLike))):
        raise TypeError(
            f"root must be a directory path (str or pathlib.Path) or None for "
            f"{DATA_ENV} / the user cache, got {type(root).__name__} {root!r}"
        )
    root = Path(root).expanduser() if root is not None else data_root()
    if root.exists() and not root.is_dir():
        raise ValueError(
            f"the data root {root} is a file, not a directory: pass (or set {DATA_ENV} to) "
            "the directory that holds FashionMNIST/raw/"
        )
    raw = root / "FashionMNIST" / "raw"
    # torchvision downloads all four files unless all four are there.
    missing = [name for name in FASHION_MNIST_FILES if not (raw / name).exists()]
    dataset = None
    if missing:
        _check_writable(raw, missing)
        import torchvision

        try:
            dataset = torchvision.datasets.FashionMNIST(
                root=str(root), train=train, transform=transform, download=True
            )
        except (OSError, RuntimeError) as err:
            # URLError and HTTPError are OSErrors; torchvision raises RuntimeError after
            # every mirror failed. Either way the user needs to know where we looked.
            raise RuntimeError(
                f"Fashion-MNIST is not under {raw} (missing: {', '.join(missing)}) and could "
                f"not be downloaded ({type(err).__name__}: {err}). Connect to the internet, "
                "or copy the four raw files (train-images-idx3-ubyte, ...) there, or set "
                f"{DATA_ENV} to a directory that holds FashionMNIST/raw/."
            ) from err
    prefix = "train" if train else "t10k"
    names = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
    for name in names:
        if (raw / name).exists():  # absent only where torchvision's legacy files were used
            verify_fashion_mnist_file(raw / name)
    if tensors and all((raw / name).exists() for name in names):
        return _read_idx(raw / names[0]), _read_idx(raw / names[1]).long()
    if dataset is None:
        import torchvision

        dataset = torchvision.datasets.FashionMNIST(
            root=str(root), train=train, transform=transform, download=False
        )
    return (dataset.data, dataset.targets) if tensors else dataset


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
    With usable GPUs (:func:`d2lgpu.num_gpus`): 4 per GPU, at most 8 (small images
    decode fast; more workers only cost memory and start-up time, and each loader keeps
    its own), so decoding keeps up with the GPUs. CPU only, which includes GPUs this
    torch build has no kernels for (a P100 under a CUDA 13 wheel): the model already
    uses every core, so 2 workers, and 0 on a machine with 2 cores or fewer. Never more
    than the cores this process may use.
    """
    check_bool("quick", quick, none_means="follow D2LGPU_QUICK")
    # Not small_data(): smoke mode keeps full mode's worker processes, to run their code.
    quick = quick_mode() if quick is None else quick
    cores = _usable_cores()
    if quick:
        return 0
    gpus = num_gpus()
    if gpus:
        return min(4 * gpus, 8, cores)
    return 0 if cores <= 2 else 2


def _pin_memory() -> bool:
    """Whether the loaders pin host memory: where the batches go to a GPU the course uses.
    Without one (no CUDA, or GPUs without kernels in this build) pinning buys nothing."""
    return num_gpus() > 0


def load_data_fashion_mnist(
    batch_size: int,
    resize: int | tuple[int, int] | None = None,
    root: str | Path | None = None,
    *,
    num_workers: int | None = None,
    quick: bool | None = None,
) -> tuple[data.DataLoader, data.DataLoader]:
    """Train and test DataLoaders for Fashion-MNIST (float images in [0, 1], shape [B, 1, H, W])
    (chapter 3).

    ``resize`` scales images up (ResNet chapters in d2l use 96); ``quick=None`` follows
    :func:`d2lgpu.quick_mode`. The training loader shuffles with torch's global RNG,
    so :func:`d2lgpu.set_seed` makes its order reproducible. Memory is pinned only when
    the course uses a GPU here (pinning is useless without one, and warns without CUDA).
    """
    from torchvision import transforms

    check_positive_int("batch_size", batch_size)
    check_bool("quick", quick, none_means="follow D2LGPU_QUICK")
    if resize is not None:
        if not isinstance(resize, (int, tuple, list)):
            raise ValueError(
                f"resize must be a positive int or a pair of them (or None), got {resize!r}"
            )
        sizes = (resize,) if isinstance(resize, int) else tuple(resize)
        if not 1 <= len(sizes) <= 2 or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes
        ):
            raise ValueError(
                f"resize must be a positive int or a pair of them (or None), got {resize!r}"
            )
    if num_workers is not None and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
    ):
        raise ValueError(f"num_workers must be an int >= 0 or None, got {num_workers!r}")
    workers = default_num_workers(quick) if num_workers is None else num_workers
    quick = small_data() if quick is None else quick

    steps: list = [transforms.ToTensor()]
    if resize is not None:
        steps.insert(0, transforms.Resize(resize))
    transform = transforms.Compose(steps)

    train_set = _fashion_mnist_dataset(True, root, transform)
    test_set = _fashion_mnist_dataset(False, root, transform)
    if quick:
        train_set = data.Subset(train_set, _balanced_indices(train_set.targets, _subset_size(True)))
        test_set = data.Subset(test_set, _balanced_indices(test_set.targets, _subset_size(False)))

    common = dict(
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=_pin_memory(),
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
    """The whole split as tensors: images uint8 [N, 1, 28, 28] and labels int64 [N] (chapter 3).

    For code that keeps the data set on the GPU and slices batches itself instead of
    using a DataLoader. Quick mode gives the same balanced subset as the loaders.
    """
    check_bool("train", train)
    check_bool("quick", quick, none_means="follow D2LGPU_QUICK")
    images, labels = _fashion_mnist_dataset(train, root, tensors=True)
    images = images.unsqueeze(1).to(torch.uint8)
    labels = labels.to(torch.int64)
    if small_data() if quick is None else quick:
        idx = _balanced_indices(labels, _subset_size(train))
        images, labels = images[idx], labels[idx]
    return images.contiguous(), labels.contiguous()


def synthetic_regression(
    num_examples: int,
    num_features: int,
    noise: float = 0.01,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear regression problem: ``X`` float32 [N, F] and ``y = X w + b + noise``, [N, 1]
    (chapter 5).

    The weights, bias and noise come from a private generator seeded with ``seed``,
    so the data are the same everywhere and do not disturb torch's global RNG.
    Wrap them with ``torch.utils.data.TensorDataset(X, y)`` for a DataLoader.
    """
    check_positive_int("num_examples", num_examples)
    check_positive_int("num_features", num_features)
    check_seed(seed)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not (
        math.isfinite(noise) and noise >= 0
    ):
        raise ValueError(
            f"noise is a standard deviation and must be a finite number >= 0, got {noise!r}"
        )
    gen = torch.Generator().manual_seed(seed)
    true_w = torch.randn(num_features, 1, generator=gen)
    true_b = torch.randn(1, generator=gen)
    X = torch.randn(num_examples, num_features, generator=gen)
    y = X @ true_w + true_b + noise * torch.randn(num_examples, 1, generator=gen)
    return X, y


# --------------------------------------------------------------------------- #
# The whole data set on the device
# --------------------------------------------------------------------------- #


#: Mean and standard deviation of the Fashion-MNIST training pixels scaled to [0, 1]
#: (all 60,000 images; computed with ``fashion_mnist_tensors`` in float64).
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530


class DeviceLoader:
    """Batches ``(X, y)`` cut from a data set that lives on ``device``, without a DataLoader
    (chapter 7).

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
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last),
                            ("channels_last", channels_last)):
            check_bool(name, value)
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
    """Fashion-MNIST train and test sets held on ``device``: shuffled train batches, test in order
    (chapter 7).

    ``device=None`` means :func:`d2lgpu.try_gpu`. ``quick=None`` follows quick mode
    (the same balanced subset as :func:`d2lgpu.load_data_fashion_mnist`). The test
    loader uses ``test_batch_size`` (None: at least 1024; evaluation keeps no
    activations for backward, so larger batches fit and launch fewer kernels).
    """
    check_positive_int("batch_size", batch_size)
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


# --------------------------------------------------------------------------------------
# Tiny Shakespeare (chapter 10)
# --------------------------------------------------------------------------------------

#: Where Tiny Shakespeare comes from: Andrej Karpathy's char-rnn repository, the file that
#: nanoGPT's ``shakespeare_char`` example also downloads.
TINY_SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                        "tinyshakespeare/input.txt")
#: The published file's sha256 (1,115,394 bytes).
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def tiny_shakespeare(root: str | Path | None = None) -> str:
    """Tiny Shakespeare as one string, read from ``<root>/tinyshakespeare/input.txt``.

    ``root=None`` means :func:`d2lgpu.data_root` (``D2LGPU_DATA`` or the user cache).
    A missing file is downloaded from :data:`TINY_SHAKESPEARE_URL`; either way the
    bytes must have the published sha256, so a truncated download or an edited copy
    stops here with the path and the fix. Introduced in chapter 10.
    """
    import urllib.request

    if root is not None and (isinstance(root, bool) or not isinstance(root, (str, os.PathLike))):
        raise TypeError(f"root must be a directory path (str or pathlib.Path) or None for "
                        f"{DATA_ENV} / the user cache, got {type(root).__name__} {root!r}")
    path = (Path(root).expanduser() if root is not None else data_root()) / "tinyshakespeare" \
        / "input.txt"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".part")  # renamed only once whole: no half file stays
            with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=60) as response:
                partial.write_bytes(response.read())
            partial.replace(path)
        except OSError as err:  # URLError, timeouts and a read-only folder are all OSErrors
            raise RuntimeError(
                f"Tiny Shakespeare is not at {path} and could not be downloaded "
                f"({type(err).__name__}: {err}). Connect to the internet, or put the file from "
                f"{TINY_SHAKESPEARE_URL} there, or set {DATA_ENV} to a directory that holds "
                "tinyshakespeare/input.txt.") from err
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        raise RuntimeError(
            f"{path} is not the published Tiny Shakespeare: {len(raw):,} bytes with sha256 "
            f"{digest[:16]}..., expected 1,115,394 bytes with sha256 "
            f"{TINY_SHAKESPEARE_SHA256[:16]}.... Delete it to download it again, or copy the "
            f"file from {TINY_SHAKESPEARE_URL}.")
    return raw.decode("utf-8")
