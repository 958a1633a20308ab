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
    """Put the TF32 switches back as they were after a test that changes them (both APIs)."""
    from d2lgpu.precision import set_tf32

    precision = torch.get_float32_matmul_precision()
    words = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision,
             torch.backends.cudnn.rnn.fp32_precision)
    mkldnn = torch.backends.mkldnn.matmul.fp32_precision
    yield
    set_tf32(*words)
    torch.set_float32_matmul_precision(precision)
    torch.backends.cuda.matmul.fp32_precision = words[0]
    torch.backends.mkldnn.matmul.fp32_precision = mkldnn
