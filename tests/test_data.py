"""Tests of d2lgpu.data: Fashion-MNIST loaders and tensors, quick subset, synthetic regression."""

import os
import urllib.error

import pytest
import torch
import torchvision

import d2lgpu
from d2lgpu import data as data_module
from d2lgpu.data import (
    FASHION_MNIST_LABELS,
    QUICK_TEST_SIZE,
    QUICK_TRAIN_SIZE,
    default_num_workers,
    fashion_mnist_tensors,
    get_fashion_mnist_labels,
    load_data_fashion_mnist,
    synthetic_regression,
)

needs_data = pytest.mark.skipif(
    not (d2lgpu.data_root() / "FashionMNIST" / "raw").is_dir(),
    reason="Fashion-MNIST raw files are not under D2LGPU_DATA (set it to a directory holding them)",
)


def test_labels_are_the_ten_classes():
    assert len(FASHION_MNIST_LABELS) == 10 == len(set(FASHION_MNIST_LABELS))
    assert get_fashion_mnist_labels(torch.tensor([0, 9])) == ["t-shirt", "ankle boot"]


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
def test_full_test_split_has_1000_images_per_class():
    # Fashion-MNIST's published test split: 10,000 images, 1,000 of each class.
    _, labels = fashion_mnist_tensors(train=False, quick=False)
    assert labels.bincount().tolist() == [1000] * 10


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True, None])
def test_bad_batch_size_is_rejected(batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        load_data_fashion_mnist(batch_size)


@pytest.mark.parametrize("resize", [0, -3, (28, 0), ()])
def test_bad_resize_is_rejected(resize):
    with pytest.raises(ValueError, match="resize"):
        load_data_fashion_mnist(8, resize=resize)


def test_bad_num_workers_is_rejected():
    with pytest.raises(ValueError, match="num_workers"):
        load_data_fashion_mnist(8, num_workers=-1)


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


@pytest.mark.parametrize(
    "kwargs", [dict(num_examples=0, num_features=2), dict(num_examples=5, num_features=0),
               dict(num_examples=5, num_features=2, noise=-1.0)]
)
def test_synthetic_regression_rejects_bad_input(kwargs):
    with pytest.raises(ValueError):
        synthetic_regression(**kwargs)
