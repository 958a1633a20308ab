"""Markers for tests that need GPUs (skipped with a reason where there are too few), and
fixtures several test modules share."""

import pytest
import torch


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    gpus = _visible_gpus()
    for item in items:
        if item.get_closest_marker("gpu") and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this machine has none"))
        if item.get_closest_marker("multigpu") and gpus < 2:
            item.add_marker(
                pytest.mark.skip(reason=f"needs at least 2 CUDA GPUs; this machine has {gpus}")
            )


@pytest.fixture
def restore_matmul_settings():
    """Put the TF32 switches back as they were after a test that changes them."""
    precision, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = cudnn
