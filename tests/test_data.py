"""Tests of d2lgpu.data: Fashion-MNIST loaders and tensors, quick subset, synthetic regression."""

import os
import sys
import urllib.error
from pathlib import Path

import pytest
import torch
import torchvision

import d2lgpu
from d2lgpu import data as data_module
from d2lgpu.data import (
    QUICK_TEST_SIZE,
    QUICK_TRAIN_SIZE,
    default_num_workers,
    fashion_mnist_tensors,
    load_data_fashion_mnist,
    synthetic_regression,
)


@pytest.fixture(autouse=True)
def private_stamps(tmp_path, monkeypatch):
    """Record verified files under tmp_path, never in the user's cache (or the data)."""
    stamps = tmp_path / "stamps"
    monkeypatch.setattr(data_module, "_stamp_dir", lambda: stamps)
    return stamps


needs_data = pytest.mark.skipif(
    not (d2lgpu.data_root() / "FashionMNIST" / "raw").is_dir(),
    reason="Fashion-MNIST raw files are not under D2LGPU_DATA (set it to a directory holding them)",
)


def test_quick_sizes_are_balanced_multiples_of_ten():
    assert QUICK_TRAIN_SIZE % 10 == 0 and QUICK_TEST_SIZE % 10 == 0
    assert 0 < QUICK_TEST_SIZE and 0 < QUICK_TRAIN_SIZE


@needs_data
def test_quick_loaders_are_small_balanced_and_well_typed():
    train_iter, test_iter = load_data_fashion_mnist(64, quick=True)
    assert len(train_iter.dataset) == QUICK_TRAIN_SIZE
    assert len(test_iter.dataset) == QUICK_TEST_SIZE
    X, y = next(iter(train_iter))
    assert X.shape == (64, 1, 28, 28) and X.dtype == torch.float32
    assert 0.0 <= X.min() and X.max() <= 1.0
    assert y.dtype == torch.int64
    labels = torch.cat([y for _, y in test_iter])
    assert labels.bincount(minlength=10).tolist() == [QUICK_TEST_SIZE // 10] * 10


@needs_data
def test_smoke_mode_uses_its_own_balanced_subset_and_full_modes_workers(monkeypatch):
    monkeypatch.delenv("D2LGPU_QUICK", raising=False)
    monkeypatch.setenv("D2LGPU_SMOKE", "1")
    assert data_module.SMOKE_TRAIN_SIZE % 10 == 0 and data_module.SMOKE_TEST_SIZE % 10 == 0
    images, labels = d2lgpu.fashion_mnist_tensors(train=True)
    assert len(images) == data_module.SMOKE_TRAIN_SIZE >= 200  # chapter 3 takes 5 x 40
    assert labels.bincount(minlength=10).tolist() == [data_module.SMOKE_TRAIN_SIZE // 10] * 10
    _, test_iter = load_data_fashion_mnist(50)
    assert len(test_iter.dataset) == data_module.SMOKE_TEST_SIZE >= 200  # chapter 4 takes 200
    # Worker processes as full mode has them (on a GPU machine: 4 per GPU), not quick's 0.
    monkeypatch.setattr(data_module, "_usable_cores", lambda: 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert data_module.default_num_workers() == 4


@needs_data
def test_resize_changes_the_image_size():
    train_iter, _ = load_data_fashion_mnist(8, resize=32, quick=True)
    X, _ = next(iter(train_iter))
    assert X.shape == (8, 1, 32, 32)


@needs_data
def test_pin_memory_only_with_cuda():
    train_iter, test_iter = load_data_fashion_mnist(8, quick=True)
    assert train_iter.pin_memory == test_iter.pin_memory == torch.cuda.is_available()


@needs_data
def test_tensors_match_the_loader_subset_and_are_deterministic():
    images, labels = fashion_mnist_tensors(train=False, quick=True)
    assert images.shape == (QUICK_TEST_SIZE, 1, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (QUICK_TEST_SIZE,) and labels.dtype == torch.int64
    assert labels.bincount(minlength=10).tolist() == [QUICK_TEST_SIZE // 10] * 10
    again_images, again_labels = fashion_mnist_tensors(train=False, quick=True)
    assert torch.equal(images, again_images) and torch.equal(labels, again_labels)
    # The (unshuffled) test loader yields the same images, scaled by ToTensor to [0, 1].
    _, test_iter = load_data_fashion_mnist(QUICK_TEST_SIZE, quick=True)
    X, y = next(iter(test_iter))
    assert torch.equal(y, labels)
    assert torch.allclose(X, images.float() / 255)


@needs_data
def test_tensors_are_torchvisions_read_without_importing_it(monkeypatch):
    # Child processes (DDP and FSDP ranks) load the data this way: importing torchvision
    # would cost each of them seconds. None in sys.modules makes `import torchvision` fail.
    monkeypatch.setitem(sys.modules, "torchvision", None)
    splits = {train: fashion_mnist_tensors(train=train, quick=False) for train in (True, False)}
    monkeypatch.undo()
    for train, (images, labels) in splits.items():
        reference = torchvision.datasets.FashionMNIST(
            str(d2lgpu.data_root()), train=train, download=False
        )
        assert images.shape == (len(reference), 1, 28, 28) and images.dtype == torch.uint8
        assert torch.equal(images[:, 0], reference.data)
        assert torch.equal(labels, reference.targets) and labels.dtype == torch.int64


def test_a_file_that_is_not_idx_is_refused(tmp_path):
    path = tmp_path / "t10k-labels-idx1-ubyte"
    path.write_bytes(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + bytes(4))  # 4 of 5 labels
    with pytest.raises(RuntimeError, match="not an unsigned-byte IDX file"):
        data_module._read_idx(path)
    path.write_bytes(b"\x00\x00\x08\x01" + (4).to_bytes(4, "big") + bytes([1, 2, 3, 4]))
    assert data_module._read_idx(path).tolist() == [1, 2, 3, 4]


@needs_data
def test_full_test_split_has_1000_images_per_class():
    # Fashion-MNIST's published test split: 10,000 images, 1,000 of each class.
    _, labels = fashion_mnist_tensors(train=False, quick=False)
    assert labels.bincount().tolist() == [1000] * 10


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, None])
def test_bad_batch_size_is_rejected(batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        load_data_fashion_mnist(batch_size)


def test_missing_data_names_the_environment_variable(tmp_path, monkeypatch):
    # No network in CI: make the download fail at once, as it would offline.
    def offline(self):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "download", offline)
    monkeypatch.setenv("D2LGPU_DATA", str(tmp_path))
    with pytest.raises(RuntimeError, match="D2LGPU_DATA") as info:
        fashion_mnist_tensors(quick=True)
    assert str(tmp_path) in str(info.value)
    assert isinstance(info.value.__cause__, urllib.error.URLError)
    with pytest.raises(RuntimeError, match="could not be downloaded"):
        load_data_fashion_mnist(8, root=tmp_path, quick=True)


def test_default_workers_fit_the_machine(monkeypatch):
    assert default_num_workers(quick=True) == 0
    assert 0 <= default_num_workers(quick=False) <= (os.cpu_count() or 1)
    monkeypatch.setattr(data_module, "_usable_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_num_workers(quick=False) == 0  # two cores are busy with the model
    monkeypatch.setattr(data_module, "_usable_cores", lambda: 6)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert default_num_workers(quick=False) == 6  # capped by the cores
    monkeypatch.setattr(data_module, "_usable_cores", lambda: 64)
    assert default_num_workers(quick=False) == 8  # capped: more would only cost memory
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_num_workers(quick=False) == 4  # four per GPU


def test_synthetic_regression_is_linear_and_reproducible():
    X, y = synthetic_regression(200, 5, noise=0.0, seed=3)
    assert X.shape == (200, 5) and y.shape == (200, 1) and X.dtype == torch.float32
    # Without noise, y is exactly X w + b: least squares with a bias column fits it.
    design = torch.cat([X, torch.ones(200, 1)], dim=1).double()
    solution = torch.linalg.lstsq(design, y.double()).solution
    assert torch.allclose(design @ solution, y.double(), atol=1e-5)
    X2, y2 = synthetic_regression(200, 5, noise=0.0, seed=3)
    assert torch.equal(X, X2) and torch.equal(y, y2)
    X3, _ = synthetic_regression(200, 5, noise=0.0, seed=4)
    assert not torch.equal(X, X3)


def test_synthetic_regression_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    synthetic_regression(10, 2)
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------- #
# Bad arguments
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "call, name",
    [(lambda: fashion_mnist_tensors(train="no"), "train"),
     (lambda: fashion_mnist_tensors(train=1), "train")],
)
def test_train_and_quick_take_bools_only(call, name):
    # A non-empty string is truthy: train="no" would silently give the training split.
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        call()


# --------------------------------------------------------------------------- #
# Checking the raw files
# --------------------------------------------------------------------------- #

RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@pytest.fixture
def data_copy(tmp_path, monkeypatch):
    """A data root whose raw files are links to the real ones; a test replaces one by a
    damaged copy. Nothing is written where the real files are."""
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    real = d2lgpu.data_root() / "FashionMNIST" / "raw"
    for name in RAW_FILES:
        (raw / name).symlink_to((real / name).resolve())
    monkeypatch.setenv("D2LGPU_DATA", str(tmp_path / "data"))

    def offline(self):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "download", offline)
    return raw


def _damage(raw: Path, name: str, change) -> Path:
    """Replace the link ``raw / name`` by a copy of the real file changed by ``change``."""
    path = raw / name
    content = bytearray(path.read_bytes())
    path.unlink()
    path.write_bytes(bytes(change(content)))
    return path


@needs_data
def test_verified_files_are_hashed_once_and_nothing_is_written_next_to_them(
    data_copy, private_stamps, monkeypatch
):
    hashed = []
    md5 = data_module._md5_of_file
    monkeypatch.setattr(data_module, "_md5_of_file", lambda path: hashed.append(path.name)
                        or md5(path))
    before = sorted(p.name for p in data_copy.iterdir())
    fashion_mnist_tensors(train=False, quick=True)
    assert sorted(hashed) == ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    fashion_mnist_tensors(train=False, quick=True)
    assert len(hashed) == 2  # the stamps of the first check are reused
    assert len(list(private_stamps.iterdir())) == 2
    assert sorted(p.name for p in data_copy.iterdir()) == before


@needs_data
def test_a_truncated_file_says_how_much_is_missing(data_copy):
    path = _damage(data_copy, "t10k-labels-idx1-ubyte", lambda b: b[:5000])
    with pytest.raises(RuntimeError, match=r"is truncated or corrupt: it has 5000 of the "
                                           r"official file's 10008 bytes") as info:
        fashion_mnist_tensors(train=False)
    assert str(path) in str(info.value) and "Delete it" in str(info.value)


@needs_data
def test_what_is_not_a_regular_file_is_named_for_what_it_is(data_copy):
    path = data_copy / "t10k-labels-idx1-ubyte"
    path.unlink()
    path.mkdir()  # a directory where the file should be: its size reads 4096
    with pytest.raises(RuntimeError, match=r"t10k-labels-idx1-ubyte is not a regular file \(a "
                                           r"directory.*raw file t10k-labels-idx1-ubyte \(10008"):
        fashion_mnist_tensors(train=False)
    path.rmdir()
    path.symlink_to(data_copy / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"does not exist \(a broken symbolic link\)"):
        data_module.verify_fashion_mnist_file(path)


@needs_data
def test_an_empty_labels_file_is_named_not_blamed_on_the_network(data_copy):
    _damage(data_copy, "t10k-labels-idx1-ubyte", lambda b: b"")
    with pytest.raises(RuntimeError, match=r"t10k-labels-idx1-ubyte is truncated or corrupt: "
                                           r"it has 0 of") as info:
        fashion_mnist_tensors(train=False)
    assert "internet" not in str(info.value)


def _shuffle_labels(content: bytearray) -> bytearray:
    labels = torch.tensor(list(content[8:]), dtype=torch.uint8)
    shuffled = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]
    return content[:8] + bytearray(shuffled.tolist())


@needs_data
@pytest.mark.parametrize(
    "name, change",
    [("t10k-labels-idx1-ubyte", _shuffle_labels),
     ("t10k-images-idx3-ubyte",  # pixels inverted: x -> 255 - x
      lambda b: b[:16] + bytes(b[16:]).translate(bytes(range(255, -1, -1)))),
     ("t10k-labels-idx1-ubyte", lambda b: os.urandom(len(b))),
     ("t10k-labels-idx1-ubyte", lambda b: b + b"\0")],
    ids=["shuffled-labels", "inverted-pixels", "random-bytes", "one-byte-too-many"],
)
def test_a_damaged_file_is_called_corrupt(data_copy, name, change):
    path = _damage(data_copy, name, change)
    with pytest.raises(RuntimeError, match="corrupt") as info:
        fashion_mnist_tensors(train=False)
    assert str(path) in str(info.value) and "official" in str(info.value)


@needs_data
def test_a_file_that_changes_after_its_check_is_checked_again(data_copy):
    fashion_mnist_tensors(train=False, quick=True)
    _damage(data_copy, "t10k-labels-idx1-ubyte", _shuffle_labels)
    with pytest.raises(RuntimeError, match="is corrupt"):
        fashion_mnist_tensors(train=False, quick=True)


@needs_data
def test_a_missing_file_is_named(data_copy):
    (data_copy / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(RuntimeError, match="missing: t10k-labels-idx1-ubyte"):
        fashion_mnist_tensors(train=True, quick=True)


def test_a_read_only_data_directory_is_named_as_the_cause(tmp_path, monkeypatch):
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    real_access = os.access

    def access(path, mode, **kwargs):  # as for a read-only mount (root ignores chmod)
        if Path(path) == read_only and mode & os.W_OK:
            return False
        return real_access(path, mode, **kwargs)

    def download(self):
        raise AssertionError("no download should be tried into a read-only directory")

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "download", download)
    monkeypatch.setenv("D2LGPU_DATA", str(read_only))
    with pytest.raises(RuntimeError, match="not writable") as info:
        fashion_mnist_tensors(quick=True)
    assert str(read_only) in str(info.value) and "internet" not in str(info.value)


@needs_data
def test_a_file_changed_in_place_with_its_mtime_restored_is_hashed_again(data_copy):
    path = _damage(data_copy, "t10k-labels-idx1-ubyte", lambda b: b)  # a real copy, intact
    fashion_mnist_tensors(train=False, quick=True)  # passes, and is stamped
    before = path.stat()
    content = bytearray(path.read_bytes())
    content[100] = (content[100] + 1) % 10  # one label changed, size kept
    with open(path, "r+b") as file:  # in place: same inode
        file.write(content)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size, before.st_mtime_ns, before.st_ino)
    with pytest.raises(RuntimeError, match="is corrupt"):
        fashion_mnist_tensors(train=False, quick=True)


@needs_data
@pytest.mark.parametrize("placed, under", [
    ("t10k-images-idx3-ubyte", "train-images-idx3-ubyte"),
    ("t10k-labels-idx1-ubyte", "train-labels-idx1-ubyte"),
    ("train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"),
])
def test_a_file_under_another_files_name_is_named_as_that_file(data_copy, placed, under):
    (data_copy / under).unlink()
    (data_copy / under).symlink_to((data_copy / placed).resolve())
    with pytest.raises(RuntimeError, match=rf"is the official {placed} .*under the wrong name"):
        data_module.verify_fashion_mnist_file(data_copy / under)


def test_bad_roots_are_named(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(RuntimeError, match=r"is a regular file, not a directory"):
        fashion_mnist_tensors(root=a_file)
    with pytest.raises(RuntimeError, match=r"under /proc"):
        fashion_mnist_tensors(root="/proc/d2lgpu-data")
