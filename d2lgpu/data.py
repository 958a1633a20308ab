"""Data for the course: Fashion-MNIST (loaders, whole-set tensors, batches cut on the device),
synthetic regression and Tiny Shakespeare, under :func:`d2lgpu.data_root`. Fashion-MNIST's raw
files are checked (size, and once their MD5) before they are read."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils import data

from d2lgpu.runtime.checks import check_bool, check_positive_int, check_seed, check_writable_path
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
    "FASHION_MNIST_FILES", "FASHION_MNIST_MEAN", "FASHION_MNIST_STD",
    "DeviceLoader", "QUICK_TEST_SIZE", "QUICK_TRAIN_SIZE", "TINY_SHAKESPEARE_SHA256",
    "TINY_SHAKESPEARE_URL", "default_num_workers", "fashion_mnist_on_device",
    "fashion_mnist_tensors", "load_data_fashion_mnist", "synthetic_regression", "tiny_shakespeare",
    "verify_fashion_mnist_file",
]

#: Images in the quick-mode subsets (multiples of 10: balanced classes).
QUICK_TRAIN_SIZE = 500
QUICK_TEST_SIZE = 200
#: Smoke mode trains full mode's models on fewer: chapter 3 takes 5 batches of 40.
SMOKE_TRAIN_SIZE = 200
SMOKE_TEST_SIZE = 200

#: The four raw files, official and unpacked: (size in bytes, MD5).
FASHION_MNIST_FILES: dict[str, tuple[int, str]] = {
    "train-images-idx3-ubyte": (47_040_016, "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
    "train-labels-idx1-ubyte": (60_008, "9018921c3c673c538a1fc5bad174d6f9"),
    "t10k-images-idx3-ubyte": (7_840_016, "8181f5470baa50b63fa0f6fddb340f0a"),
    "t10k-labels-idx1-ubyte": (10_008, "15d484375f8d13e6eb1aabb0c3f46965"),
}

#: Mean and standard deviation of the training pixels scaled to [0, 1] (all 60,000 images).
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530


def _balanced_indices(targets: torch.Tensor, train: bool) -> torch.Tensor:
    """The first images of every class, in file order: the smoke or quick subset, balanced and
    identical everywhere."""
    if smoke_mode():
        size = SMOKE_TRAIN_SIZE if train else SMOKE_TEST_SIZE
    else:
        size = QUICK_TRAIN_SIZE if train else QUICK_TEST_SIZE
    chosen = [torch.nonzero(targets == c).flatten()[:size // 10] for c in range(10)]
    return torch.sort(torch.cat(chosen)).values


def _stamp_dir() -> Path:  # never next to the data, which may be read-only
    return default_cache_dir() / "verified"


def _md5_of_file(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as file:
        while chunk := file.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_fashion_mnist_file(path: str | Path) -> None:
    """Check one raw Fashion-MNIST file's size, and once its MD5 (a stamp in the user cache
    keyed by path, size, inode and times): an error naming the cause and the fix (chapter 3)."""
    path = Path(path)
    size, md5 = FASHION_MNIST_FILES[path.name]
    fix = ("Delete it and run again to download it afresh, or copy the official file there "
           "(https://github.com/zalandoresearch/fashion-mnist, unpacked).")
    if not path.exists():
        broken = " (a broken symbolic link)" if path.is_symlink() else ""
        raise FileNotFoundError(f"{path} does not exist{broken}: run again to download it, or "
                                "copy the official file there")
    if not path.is_file():  # a directory's size (4096) would read as a truncated download
        raise RuntimeError(f"{path} is not a regular file (a directory, device or pipe): put the "
                           f"raw file {path.name} ({size} bytes) there, or run again")
    stat = path.stat()
    if stat.st_size != size:  # the four official sizes differ: it may be another one
        for name, (other_size, other_md5) in FASHION_MNIST_FILES.items():
            if other_size == stat.st_size and _md5_of_file(path) == other_md5:
                raise RuntimeError(f"{path} is not {path.name}: it is the official {name} (same "
                                   "size and MD5) under the wrong name. Put the right file there.")
        raise RuntimeError(f"{path} is truncated or corrupt: it has {stat.st_size} of the official "
                           f"file's {size} bytes (an interrupted download or copy?). {fix}")
    key = (f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|"
           f"{stat.st_dev}:{stat.st_ino}|{md5}")
    stamp = _stamp_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]
    if stamp.exists():
        return
    actual = _md5_of_file(path)
    if actual != md5:
        raise RuntimeError(
            f"{path} is corrupt: its MD5 is {actual}, the official file's is {md5} (the size "
            f"is right, the content is not). {fix}")
    with contextlib.suppress(OSError):  # a read-only cache only means hashing again next time
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(key + "\n")


def _read_idx(path: Path) -> torch.Tensor:
    """An unsigned-byte IDX file (the raw MNIST format) as a uint8 tensor of its shape."""
    buffer = bytearray(path.read_bytes())
    ndim = buffer[3]
    header = 4 + 4 * ndim
    shape = [int.from_bytes(buffer[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if buffer[:3] != b"\x00\x00\x08" or len(buffer) != header + math.prod(shape):
        raise RuntimeError(f"{path} is not an unsigned-byte IDX file of the size its header says")
    return torch.frombuffer(buffer, dtype=torch.uint8, offset=header).view(shape)


def _fashion_mnist_files(train: bool, root: str | Path | None) -> tuple[Path, Path]:
    """The split's (images, labels) raw files, downloaded when missing, then checked."""
    root = Path(root).expanduser() if root is not None else data_root()
    raw = root / "FashionMNIST" / "raw"
    missing = [name for name in FASHION_MNIST_FILES if not (raw / name).exists()]
    if missing:  # torchvision downloads all four unless all four are there
        where = f"Fashion-MNIST is not under {raw} (missing: {', '.join(missing)})"
        copy = f"or copy the four raw files (train-images-idx3-ubyte, ...) into {raw}"
        try:
            check_writable_path("the data directory", raw, kind="directory")
        except (ValueError, PermissionError) as err:
            raise RuntimeError(f"{where}, and it cannot be downloaded there: {err}. Set "
                               f"{DATA_ENV} (or pass root=) to a writable directory, {copy}."
                               ) from None
        from torchvision.datasets import FashionMNIST

        try:
            FashionMNIST(root=str(root), train=train, download=True)
        except (OSError, RuntimeError) as err:  # offline, or every mirror failed
            raise RuntimeError(
                f"{where} and could not be downloaded ({type(err).__name__}: {err}). Connect "
                f"to the internet, {copy}, or set {DATA_ENV} to a directory that holds "
                "FashionMNIST/raw/.") from err
    prefix = "train" if train else "t10k"
    paths = (raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte")
    for path in paths:
        verify_fashion_mnist_file(path)
    return paths


def _usable_cores() -> int:
    """CPU cores this process may run on (a container or ``taskset`` can allow fewer)."""
    if hasattr(os, "sched_getaffinity"):  # not on macOS or Windows
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def default_num_workers(quick: bool | None = None) -> int:
    """DataLoader worker processes that suit this machine (chapter 4): none in quick mode
    (workers start slower than a few hundred images load), 4 per GPU up to 8, and on a CPU 2,
    none with 2 cores or fewer (the model uses them); never more than the usable cores."""
    # Not small_data(): smoke mode keeps full mode's worker processes, to run their code.
    if quick_mode() if quick is None else quick:
        return 0
    cores = _usable_cores()
    gpus = num_gpus()
    if gpus:
        return min(4 * gpus, 8, cores)
    return 0 if cores <= 2 else 2


def _pin_memory() -> bool:
    """Pin host memory only where a GPU the course uses reads the batches."""
    return num_gpus() > 0


def load_data_fashion_mnist(batch_size: int, resize: int | tuple[int, int] | None = None,
                            root: str | Path | None = None, *, num_workers: int | None = None,
                            quick: bool | None = None) -> tuple[data.DataLoader, data.DataLoader]:
    """Train and test DataLoaders of Fashion-MNIST, images in [0, 1] (chapter 3)."""
    from torchvision import transforms
    from torchvision.datasets import FashionMNIST

    check_positive_int("batch_size", batch_size)
    workers = default_num_workers(quick) if num_workers is None else num_workers
    steps = [transforms.Resize(resize)] if resize is not None else []
    transform = transforms.Compose([*steps, transforms.ToTensor()])
    train_set, test_set = (FashionMNIST(str(_fashion_mnist_files(train, root)[0].parents[2]),
                                        train, transform) for train in (True, False))
    if small_data() if quick is None else quick:
        train_set = data.Subset(train_set, _balanced_indices(train_set.targets, True))
        test_set = data.Subset(test_set, _balanced_indices(test_set.targets, False))
    # Workers that survive between epochs save their start-up time every epoch.
    common = dict(batch_size=batch_size, num_workers=workers, pin_memory=_pin_memory(),
                  persistent_workers=workers > 0)
    return (data.DataLoader(train_set, shuffle=True, **common),
            data.DataLoader(test_set, shuffle=False, **common))


def fashion_mnist_tensors(train: bool = True, root: str | Path | None = None,
                          quick: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole split: images uint8 [N, 1, 28, 28] and labels int64 [N] (chapter 3)."""
    check_bool("train", train)  # a truthy "no" would give the training split
    # Read without importing torchvision (seconds in a child process).
    images, labels = (_read_idx(path) for path in _fashion_mnist_files(train, root))
    images, labels = images.unsqueeze(1), labels.long()
    if small_data() if quick is None else quick:
        idx = _balanced_indices(labels, train)
        images, labels = images[idx], labels[idx]
    return images.contiguous(), labels.contiguous()


def synthetic_regression(num_examples: int, num_features: int, noise: float = 0.01,
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``X`` [N, F] and ``y = X w + b + noise`` [N, 1] from a private generator, so the
    global RNG is left alone (chapter 5)."""
    gen = torch.Generator().manual_seed(seed)
    true_w = torch.randn(num_features, 1, generator=gen)
    true_b = torch.randn(1, generator=gen)
    X = torch.randn(num_examples, num_features, generator=gen)
    y = X @ true_w + true_b + noise * torch.randn(num_examples, 1, generator=gen)
    return X, y


def _check_images_and_labels(images: object, labels: object) -> None:
    """A ValueError unless ``images`` is uint8 [N, C, H, W] and ``labels`` N integer classes."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
        got = (f"{images.dtype} of shape {tuple(images.shape)}"
               if isinstance(images, torch.Tensor) else type(images).__name__)
        raise ValueError(f"images must be a uint8 tensor [N, C, H, W], got {got}; d2lgpu."
                         "fashion_mnist_tensors() returns one (or add a channel with unsqueeze(1))")
    if not (isinstance(labels, torch.Tensor) and labels.dim() == 1
            and not labels.is_floating_point() and labels.dtype != torch.bool):
        raise ValueError("labels must be a 1-d tensor of integers, one class per image")
    if not 0 < labels.numel() == images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.numel()} labels: they must "
                         "match one to one (and not be empty)")


class DeviceLoader:
    """Batches ``(X, y)`` cut from uint8 images that live on ``device``, normalised there with
    Fashion-MNIST's statistics (chapter 7), shuffled on the device by a seeded generator."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, *,
                 device: torch.device | str, shuffle: bool = False, seed: int = 0,
                 channels_last: bool = False) -> None:
        _check_images_and_labels(images, labels)
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.shuffle = check_bool("shuffle", shuffle)
        self.channels_last = check_bool("channels_last", channels_last)
        self.device = require_cuda_device(device, "DeviceLoader")
        # x * scale + shift == (x / 255 - mean) / std: one multiply and one add per element
        std = torch.tensor(FASHION_MNIST_STD)
        self._scale = (1.0 / (255.0 * std)).to(self.device)
        self._shift = (-torch.tensor(FASHION_MNIST_MEAN) / std).to(self.device)
        self.images = images.to(self.device).contiguous()  # stays uint8 on the device
        self.labels = labels.to(self.device, torch.int64)
        self.generator = torch.Generator(device=self.device)
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        """Restart the shuffling: the next epochs repeat those after the same seed."""
        self.generator.manual_seed(check_seed(seed))

    @property
    def num_examples(self) -> int:
        return self.images.shape[0]

    def __len__(self) -> int:
        return math.ceil(self.num_examples / self.batch_size)

    def normalize(self, images_uint8: torch.Tensor) -> torch.Tensor:
        """uint8 images on the device -> float32 ``(x / 255 - mean) / std``."""
        X = images_uint8.to(torch.float32).mul_(self._scale).add_(self._shift)
        return X.contiguous(memory_format=torch.channels_last) if self.channels_last else X

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = self.num_examples
        order = (torch.randperm(n, device=self.device, generator=self.generator) if self.shuffle
                 else torch.arange(n, device=self.device))
        # split() only slices the index tensor: no kernel launches, no host sync.
        for idx in order.split(self.batch_size):
            yield self.normalize(self.images[idx]), self.labels[idx]


def fashion_mnist_on_device(batch_size: int, device: torch.device | str, *,
                            root: str | Path | None = None, quick: bool | None = None,
                            seed: int = 0, test_batch_size: int | None = None,
) -> tuple[DeviceLoader, DeviceLoader]:
    """Fashion-MNIST held on ``device``: shuffled train batches, test in order (chapter 7).
    Test batches are at least 1024 (no activations kept: larger batches fit, fewer launches)."""
    if test_batch_size is not None:
        check_positive_int("test_batch_size", test_batch_size)
    loaders = []
    for train in (True, False):
        images, labels = fashion_mnist_tensors(train=train, root=root, quick=quick)
        size = batch_size if train else test_batch_size or max(batch_size, 1024)
        # channels_last: the same layout for one channel, right for RGB data sets too.
        loaders.append(DeviceLoader(images, labels, size, device=device, shuffle=train,
                                    seed=seed, channels_last=True))
    return loaders[0], loaders[1]


#: Tiny Shakespeare from Karpathy's char-rnn repository (what nanoGPT's example downloads).
TINY_SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                        "tinyshakespeare/input.txt")
#: The published file's sha256 (1,115,394 bytes).
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def tiny_shakespeare(root: str | Path | None = None) -> str:
    """Tiny Shakespeare as one string, from ``<root>/tinyshakespeare/input.txt`` (chapter 10),
    downloaded when missing; bytes without the published sha256 are refused."""
    root = Path(root).expanduser() if root is not None else data_root()
    path = root / "tinyshakespeare" / "input.txt"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".part")  # renamed only once whole: no half file stays
            with urllib.request.urlopen(TINY_SHAKESPEARE_URL, timeout=60) as response:
                partial.write_bytes(response.read())
            partial.replace(path)
        except OSError as err:  # URLError, timeouts and a read-only folder are all OSErrors
            raise RuntimeError(f"Tiny Shakespeare is not at {path} and could not be downloaded "
                               f"({type(err).__name__}: {err}). Connect to the internet, or put "
                               f"the file from {TINY_SHAKESPEARE_URL} there, or set {DATA_ENV} "
                               "to a directory that holds tinyshakespeare/input.txt.") from err
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        raise RuntimeError(f"{path} is not the published Tiny Shakespeare ({len(raw):,} bytes, "
                           "not 1,115,394 with its sha256). Delete it to download it again, or "
                           f"copy the file from {TINY_SHAKESPEARE_URL}.")
    return raw.decode("utf-8")
