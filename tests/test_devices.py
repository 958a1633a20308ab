"""Tests of d2lgpu.devices: naming the CPU and GPUs, and refusing bad indices."""


import numpy as np
import pytest
import torch
from _fake_cuda import CU13_ARCHS, CU126_ARCHS, fake_cuda_gpus

import d2lgpu
from d2lgpu.devices import resolve_devices
from d2lgpu.runtime import gpus
from d2lgpu.runtime.gpus import require_cuda_device


def _torch_gpu_count() -> int:
    # Computed directly from torch, independently of d2lgpu.num_gpus.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_cpu():
    assert d2lgpu.cpu() == torch.device("cpu")


def test_num_gpus_matches_torch():
    assert d2lgpu.num_gpus() == _torch_gpu_count()


def test_try_all_gpus_is_never_empty():
    devices = d2lgpu.try_all_gpus()
    n = _torch_gpu_count()
    if n == 0:
        assert devices == [torch.device("cpu")]
    else:
        assert devices == [torch.device("cuda", i) for i in range(n)]


def test_try_gpu_falls_back_to_cpu_for_missing_gpu():
    assert d2lgpu.try_gpu(10_000) == torch.device("cpu")


def test_try_gpu_zero():
    expected = torch.device("cuda", 0) if _torch_gpu_count() else torch.device("cpu")
    assert d2lgpu.try_gpu() == expected


def test_try_gpu_accepts_numpy_integers():
    assert d2lgpu.try_gpu(np.int64(10_000)) == torch.device("cpu")


# Explicit ids: an id of plain "gpu" would read as the gpu marker's keyword.
@pytest.mark.parametrize("func", [d2lgpu.try_gpu, d2lgpu.gpu], ids=["try_gpu", "gpu_func"])
def test_negative_index_is_a_value_error(func):
    with pytest.raises(ValueError, match="0 or more"):
        func(-1)


@pytest.mark.parametrize("bad", ["0", 1.0, True, None])
@pytest.mark.parametrize("func", [d2lgpu.try_gpu, d2lgpu.gpu], ids=["try_gpu", "gpu_func"])
def test_non_integer_index_is_a_type_error(func, bad):
    with pytest.raises(TypeError, match="must be an int"):
        func(bad)


def test_string_index_error_names_the_fix():
    with pytest.raises(TypeError, match="write 0 instead"):
        d2lgpu.try_gpu("0")


def test_gpu_missing_index_names_try_gpu():
    with pytest.raises(RuntimeError) as excinfo:
        d2lgpu.gpu(99)
    message = str(excinfo.value)
    assert "GPU 99 does not exist" in message
    assert "try_gpu(99)" in message
    assert f"sees {_torch_gpu_count()} GPU(s)" in message


@pytest.mark.gpu
def test_gpu_zero_holds_tensors():
    device = d2lgpu.gpu(0)
    assert device == torch.device("cuda", 0)
    x = torch.ones(3, device=device)
    assert x.device == device
    assert x.sum().item() == 3


@pytest.mark.multigpu
def test_every_gpu_is_addressable():
    for i, device in enumerate(d2lgpu.try_all_gpus()):
        assert device == d2lgpu.gpu(i)
        assert torch.zeros(1, device=device).device == device


def test_as_device_reads_what_torch_reads_and_names_the_spellings_otherwise():
    assert d2lgpu.runtime.gpus.as_device("cpu") == torch.device("cpu")
    # an int is a GPU, as in torch
    assert d2lgpu.runtime.gpus.as_device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="'cuda:0'"):
        d2lgpu.runtime.gpus.as_device("cuda0")
    with pytest.raises(TypeError, match="not a device"):
        d2lgpu.runtime.gpus.as_device(True)


def test_resolve_devices():
    assert resolve_devices(None) == d2lgpu.try_all_gpus()
    assert resolve_devices("cpu") == [torch.device("cpu")]
    assert resolve_devices([torch.device("cpu")]) == [torch.device("cpu")]
    with pytest.raises(ValueError, match=r"cannot use \['cpu', 'cpu'\]: it runs on one CPU device"):
        resolve_devices(["cpu", "cpu"])
    with pytest.raises(TypeError, match="a non-empty list"):
        resolve_devices([])
    missing = f"cuda:{d2lgpu.num_gpus()}"  # one past the last visible GPU
    with pytest.raises(RuntimeError, match=f"train was given {missing}, but "):
        resolve_devices(missing)


@pytest.mark.parametrize(
    "devices, error, match",
    [("meta", ValueError, r"cannot use \['meta'\]: it runs on one CPU device"),
     (["cpu", "meta"], ValueError, "cannot use .*'meta'"), ({"cpu"}, TypeError, "list of them"),
     (0, TypeError, r"devices=0 is an int.*'cuda:0'"), ([0, 1], TypeError, "an int"),
     ("nonsense", ValueError, "not a device")],
)
def test_resolve_devices_names_the_fix_for_devices_train_cannot_use(devices, error, match):
    with pytest.raises(error, match=match):
        resolve_devices(devices)


@pytest.mark.multigpu
def test_resolve_devices_rejects_a_repeated_gpu():
    with pytest.raises(ValueError, match="repeats"):
        resolve_devices(["cuda:0", "cuda:0"])


def test_require_cuda_device_without_cuda_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert require_cuda_device("cpu", "x") == torch.device("cpu")
    for device in ("cuda", "cuda:0", 0):
        with pytest.raises(RuntimeError, match="x was given cuda") as info:
            require_cuda_device(device, "x")
        assert "python -m d2lgpu info" in str(info.value) and "try_gpu" in str(info.value)


def test_require_cuda_device_fills_in_the_current_gpu_and_refuses_a_missing_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert require_cuda_device("cuda", "x") == torch.device("cuda", 1)
    assert require_cuda_device(0, "x") == torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="cuda:2 does not exist: this process sees 2 GPU"):
        require_cuda_device("cuda:2", "x")
    assert resolve_devices(["cuda", "cuda:0"]) == [torch.device("cuda", 1), torch.device("cuda", 0)]
    with pytest.raises(ValueError, match="repeats"):
        resolve_devices(["cuda", "cuda:1"])
    with pytest.raises(ValueError, match="or on CUDA devices only"):
        resolve_devices(["cuda:0", "cpu"])


def test_require_cuda_device_names_the_spellings_of_a_bad_device():
    with pytest.raises(TypeError, match="use 'cpu', 'cuda'"):
        require_cuda_device(1.5, "x")


# Every function that takes a device reads it through this module, so a misspelt one gets
# the same error, naming the spellings, wherever it is passed.
@pytest.mark.parametrize("call", [
    lambda device: require_cuda_device(device, "x"),
    lambda device: resolve_devices(device),
    lambda device: d2lgpu.peak_tflops(device),
    lambda device: d2lgpu.time_fn(lambda: None, device),
    lambda device: d2lgpu.Techniques.fast(device),
    lambda device: d2lgpu.technique_skip_reason("precision", device),
    lambda device: d2lgpu.precision_policy(device),
    lambda device: d2lgpu.train_fast(d2lgpu.small_cnn(), [], [], 1, 0.1, device),
    lambda device: d2lgpu.DeviceLoader(torch.zeros(2, 1, 2, 2, dtype=torch.uint8),
                                       torch.zeros(2, dtype=torch.long), 1, device=device),
], ids=["require_cuda_device", "resolve_devices", "peak_tflops", "time_fn", "Techniques.fast",
        "technique_skip_reason", "precision_policy", "train_fast", "DeviceLoader"])
def test_a_misspelt_device_gets_one_error_everywhere(call):
    with pytest.raises(ValueError, match=r"'cuda0' is not a device PyTorch understands; use 'cpu'"):
        call("cuda0")


# --- a GPU this torch build has no kernels for -----------------------------------------

def test_a_p100_under_a_build_without_sm_60_is_not_usable(monkeypatch):
    from d2lgpu.runtime import config

    fake_cuda_gpus(monkeypatch, [(6, 0)], CU13_ARCHS)
    for name in ("D2LGPU_QUICK", "D2LGPU_FULL", "D2LGPU_SMOKE"):
        monkeypatch.delenv(name, raising=False)
    assert gpus.gpus_without_kernels() == [0]
    assert not gpus.cuda_usable()
    assert d2lgpu.num_gpus() == 0
    assert d2lgpu.try_gpu() == torch.device("cpu")
    assert d2lgpu.try_all_gpus() == [torch.device("cpu")]
    assert config.workload() == "cpu"
    with pytest.raises(RuntimeError, match="no kernels for a GPU here") as info:
        require_cuda_device("cuda", "train")
    assert "python -m d2lgpu info" in str(info.value)


def test_a_t4_under_a_build_with_sm_75_is_usable(monkeypatch):
    from d2lgpu.runtime import config

    fake_cuda_gpus(monkeypatch, [(7, 5)], CU13_ARCHS)
    for name in ("D2LGPU_QUICK", "D2LGPU_FULL", "D2LGPU_SMOKE"):
        monkeypatch.delenv(name, raising=False)
    assert gpus.cuda_usable() and gpus.gpus_without_kernels() == []
    assert d2lgpu.num_gpus() == 1 and d2lgpu.try_gpu() == torch.device("cuda", 0)
    assert config.workload() == "full"


def test_the_p100_is_usable_under_a_cu126_build(monkeypatch):
    fake_cuda_gpus(monkeypatch, [(6, 0)], CU126_ARCHS, cuda_build="12.6")
    assert gpus.cuda_usable() and d2lgpu.num_gpus() == 1


def test_one_gpu_without_kernels_makes_cuda_unusable_for_all(monkeypatch):
    # try_all_gpus would hand DataParallel the V100 too, and its first kernel would fail.
    fake_cuda_gpus(monkeypatch, [(7, 5), (7, 0)], CU13_ARCHS)
    assert gpus.gpus_without_kernels() == [1]
    assert d2lgpu.try_all_gpus() == [torch.device("cpu")]


@pytest.mark.parametrize("cuda_build, arch_list", [(None, ["gfx90a"]), ("13.0", [])])
def test_a_build_whose_arch_list_cannot_be_checked_is_taken_at_its_word(
        monkeypatch, cuda_build, arch_list):
    # A ROCm build (its list names gfx targets) and a build that recorded no list:
    # torch's own start-up check skips both, and so does cuda_usable.
    fake_cuda_gpus(monkeypatch, [(9, 0)], arch_list, cuda_build=cuda_build)
    assert gpus.cuda_arch_list() is None
    assert gpus.cuda_usable() and d2lgpu.num_gpus() == 1


def test_an_unreadable_gpu_does_not_hide_the_others(monkeypatch):
    fake_cuda_gpus(monkeypatch, [(6, 0), (9, 0)], CU13_ARCHS)

    def capability(i=0):
        if i == 1:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return (6, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert gpus.gpus_without_kernels() == [0]


# --- NCCL_P2P_DISABLE: the peer-to-peer decision, with faked GPUs ---------------------


def _fake_gpus(monkeypatch, names, peer=True, copy_ok=True):
    """Pretend this machine has GPUs called ``names``; record whether the copy check ran.
    ``copy_ok`` None: the check could not start (a GPU busy in exclusive mode, say)."""
    ran = []
    monkeypatch.setattr(gpus, "_PEER_COPY_VERDICTS", {})
    monkeypatch.setattr(gpus, "num_gpus", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: names[i])
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: peer)

    def copy_check():
        ran.append(True)
        if copy_ok is None:
            return None, "the peer copy check could not prepare its GPUs (OutOfMemoryError: x)"
        return (True, "") if copy_ok else (False, "peer copies arrived wrong (0->1)")

    monkeypatch.setattr(gpus, "_peer_copies_correct", copy_check)
    return ran


def test_p2p_user_value_is_kept(monkeypatch):
    _fake_gpus(monkeypatch, ["Tesla T4", "Tesla T4"])
    for value, disabled in (("0", False), ("1", True)):
        env = {"NCCL_P2P_DISABLE": value}
        decision = gpus.apply_nccl_p2p_decision(env)
        assert env == {"NCCL_P2P_DISABLE": value}
        assert decision.user_set and decision.disable is disabled
        assert "already set" in decision.reason


@pytest.mark.parametrize("count", [0, 1])
def test_p2p_fewer_than_two_gpus_sets_nothing(monkeypatch, count):
    ran = _fake_gpus(monkeypatch, ["Tesla T4"] * count)
    env = {}
    decision = gpus.apply_nccl_p2p_decision(env)
    assert not decision.disable and env == {} and not ran


def test_p2p_two_t4s_without_nvlink_disable(monkeypatch):
    ran = _fake_gpus(monkeypatch, ["Tesla T4", "Tesla T4"])
    env = {}
    decision = gpus.apply_nccl_p2p_decision(env)
    assert decision.disable and env == {"NCCL_P2P_DISABLE": "1"}
    assert "T4" in decision.reason and "\n" not in decision.reason
    assert not ran  # decided from the names, without copying
    assert str(decision).startswith("NCCL_P2P_DISABLE=1: ")


def test_p2p_broken_copy_disables(monkeypatch):
    ran = _fake_gpus(monkeypatch, ["NVIDIA A100-SXM4-40GB"] * 2, peer=True, copy_ok=False)
    env = {}
    decision = gpus.apply_nccl_p2p_decision(env)
    assert ran and decision.disable and env == {"NCCL_P2P_DISABLE": "1"}
    assert "peer access is reported" in decision.reason


def test_p2p_working_copy_keeps_p2p(monkeypatch):
    ran = _fake_gpus(monkeypatch, ["NVIDIA H100 80GB HBM3"] * 4, peer=True, copy_ok=True)
    env = {}
    decision = gpus.apply_nccl_p2p_decision(env)
    assert ran and not decision.disable and env == {}
    assert "intact" in decision.reason


def test_p2p_no_peer_access_needs_no_check(monkeypatch):
    ran = _fake_gpus(monkeypatch, ["NVIDIA L4", "NVIDIA L4"], peer=False)
    decision = gpus.apply_nccl_p2p_decision({})
    assert not decision.disable and not ran and "no pair" in decision.reason


def test_p2p_decision_is_remembered_for_the_process(monkeypatch):
    ran = _fake_gpus(monkeypatch, ["NVIDIA H100 80GB HBM3"] * 2, peer=True, copy_ok=True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for _ in range(3):  # three launches
        assert not gpus.apply_nccl_p2p_decision({}).disable
    assert len(ran) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # other GPUs: checked anew
    gpus.apply_nccl_p2p_decision({})
    assert len(ran) == 2


def test_p2p_broken_copies_are_remembered_too(monkeypatch):
    ran = _fake_gpus(monkeypatch, ["NVIDIA A100-SXM4-40GB"] * 2, peer=True, copy_ok=False)
    assert gpus.apply_nccl_p2p_decision({}).disable
    assert gpus.apply_nccl_p2p_decision({}).disable and len(ran) == 1


def test_p2p_a_check_that_cannot_start_leaves_p2p_on_and_says_why(monkeypatch):
    # Out of memory or a GPU held in exclusive mode says nothing about the peer path:
    # NVLink must not be switched off for it.
    ran = _fake_gpus(monkeypatch, ["NVIDIA A100-SXM4-80GB"] * 2, peer=True, copy_ok=None)
    env = {}
    decision = gpus.apply_nccl_p2p_decision(env)
    assert not decision.disable and env == {}
    assert "untested" in decision.reason and "OutOfMemoryError" in decision.reason
    assert "NCCL_P2P_DISABLE=1 yourself" in decision.reason
    gpus.apply_nccl_p2p_decision({})
    assert len(ran) == 2  # not remembered: the next launch tries again


def test_p2p_copy_check_reads_the_child(monkeypatch):
    # The child's verdicts, faked: intact, wrong copies, a crash or a hang during the
    # copies, and the ways it can fail before its first copy.
    class Run:
        def __init__(self, out, rc=0, err=""):
            self.stdout, self.returncode, self.stderr = out, rc, err

    def child(*args, **kwargs):
        return lambda *a, **k: Run(*args, **kwargs)

    check = gpus._peer_copies_correct
    monkeypatch.setattr(gpus.subprocess, "run", child("STARTED\nOK\n"))
    assert check() == (True, "")
    monkeypatch.setattr(gpus.subprocess, "run", child("STARTED\nBAD 0->1\n"))
    assert check() == (False, "peer copies arrived wrong (0->1)")
    monkeypatch.setattr(gpus.subprocess, "run",
                        child("STARTED\n", -11, "Segmentation fault"))
    ok, why = check()
    assert ok is False and "crashed during the copies" in why and "Segmentation" in why
    busy = ("CANNOT START AcceleratorError: CUDA error: CUDA-capable device(s) is/are busy "
            "or unavailable\n")
    monkeypatch.setattr(gpus.subprocess, "run", child(busy))
    ok, why = check()
    assert ok is None and "could not prepare its GPUs" in why and "busy" in why
    monkeypatch.setattr(gpus.subprocess, "run",
                        child("", 1, "RuntimeError: CUDA driver initialization failed"))
    ok, why = check()
    assert ok is None and "before its first copy" in why and "initialization" in why

    def hang(output):
        def run(*a, **k):
            raise gpus.subprocess.TimeoutExpired("python", 1, output=output)
        return run

    monkeypatch.setattr(gpus.subprocess, "run", hang(b"STARTED\n"))
    ok, why = check(timeout_s=1)
    assert ok is False and "did not finish" in why
    monkeypatch.setattr(gpus.subprocess, "run", hang(None))
    ok, why = check(timeout_s=1)
    assert ok is None and "did not get to its first copy" in why


def test_p2p_copy_check_runs(monkeypatch):
    # The real child, shown no GPU (it inherits this variable): it starts, has no pair
    # to copy between, and says OK.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus._peer_copies_correct() == (True, "")
