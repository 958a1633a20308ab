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


#: Variables that pytest, torch.compile (its cache directory, for its compile workers) and the
#: package's profiling (Kineto's log level, kept quiet for the whole process on purpose) set
#: for the process themselves.
_OWN_VARIABLES = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "KINETO_LOG_LEVEL")


@pytest.fixture(autouse=True)
def _environment_unchanged():
    """Fail a test that leaves os.environ changed: the notebook kernels and the ranks that later
    tests of this worker start inherit it (a leaked NCCL_P2P_DISABLE=1 changed what chapter 4
    printed). monkeypatch.setenv/delenv restore, provided the first call sees the old value."""
    import os

    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(k for k in before.keys() | after.keys()
                     if before.get(k) != after.get(k) and not k.startswith(_OWN_VARIABLES))
    if changed:
        for key in changed:  # the next tests start clean, whatever this one left
            if key in before:
                os.environ[key] = before[key]
            else:
                del os.environ[key]
        pytest.fail(f"the test left the environment changed: {', '.join(changed)} "
                    "(use monkeypatch.setenv / delenv)", pytrace=False)
