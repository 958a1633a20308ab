"""Tests of d2lgpu.report and the command line: the diagnosis, NVML, the report, `d2lgpu info`."""

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import d2lgpu
from d2lgpu import chips, report
from d2lgpu.__main__ import main
from d2lgpu.report import (
    CudaDiagnosis,
    EnvironmentReport,
    GpuInfo,
    NvmlView,
    diagnose_cuda,
    parse_cuda_visible_devices,
)
from d2lgpu.runtime import gpus

REPO_ROOT = Path(__file__).resolve().parent.parent


def _torch_gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------

PARSE_CASES = {
    "": [],
    "-1": [],
    "abc": [],
    "0,,1": [0],
    "0,abc,1": [0],
    "1,0": [1, 0],
    " 0, 1": [0, 1],
    "1gpu2,2ampere": [1, 2],
    "0,0": [],
    "GPU-aaaa,GPU-bbbb": ["GPU-aaaa", "GPU-bbbb"],
    "MIG-aaaa,0": ["MIG-aaaa"],
}


def test_parse_unset_means_every_gpu():
    assert parse_cuda_visible_devices(None) is None


@pytest.mark.parametrize("value", list(PARSE_CASES))
def test_parse_cuda_visible_devices(value):
    assert parse_cuda_visible_devices(value) == PARSE_CASES[value]


@pytest.mark.parametrize("value", list(PARSE_CASES))
def test_parse_agrees_with_torch(monkeypatch, value):
    # torch.cuda copies CUDA's reading of the variable; an independent check of ours.
    torch_parse = getattr(torch.cuda, "_parse_visible_devices", None)
    if torch_parse is None:
        pytest.skip("this torch has no torch.cuda._parse_visible_devices to compare with")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert parse_cuda_visible_devices(value) == torch_parse()


# --- the pure diagnosis --------------------------------------------------------------------


def _diagnose(**overrides) -> CudaDiagnosis:
    facts = dict(cuda_build="12.4", visible_devices_env=None, driver_found=True, device_count=0)
    facts.update(overrides)
    return diagnose_cuda(**facts)


def _codes(diagnosis: CudaDiagnosis) -> list[str]:
    return [problem.code for problem in diagnosis.problems]


def test_diagnosis_all_well():
    diagnosis = _diagnose(device_count=2)
    assert diagnosis.usable and diagnosis.device_count == 2
    assert diagnosis.cause == "ok" and diagnosis.problems == ()
    assert str(diagnosis).startswith("CUDA is usable: 2 GPU(s)")


def test_diagnosis_cpu_build():
    diagnosis = _diagnose(cuda_build=None)
    assert not diagnosis.usable
    assert diagnosis.cause == "cpu_build"
    assert "CPU-only build" in diagnosis.problems[0].why
    assert "--index-url https://download.pytorch.org/whl/" in diagnosis.problems[0].fix


@pytest.mark.parametrize("value", ["", "-1", "abc", "0,0"])
def test_diagnosis_variable_hides_every_gpu(value):
    diagnosis = _diagnose(visible_devices_env=value)
    assert not diagnosis.usable
    assert _codes(diagnosis) == ["hidden_by_env"]
    problem = diagnosis.problems[0]
    assert f"CUDA_VISIBLE_DEVICES={value!r}" in problem.why
    assert "unset CUDA_VISIBLE_DEVICES" in problem.fix


def test_diagnosis_variable_names_a_missing_gpu():
    diagnosis = _diagnose(visible_devices_env="1", physical_gpu_count=1)
    assert diagnosis.cause == "hidden_by_env"
    assert "driver sees only 1 GPU(s)" in diagnosis.problems[0].why


def test_diagnosis_malformed_variable_that_leaves_a_gpu():
    diagnosis = _diagnose(visible_devices_env="0,,1", device_count=1)
    assert diagnosis.usable
    assert _codes(diagnosis) == ["malformed_env"]
    assert "only [0]" in diagnosis.problems[0].why


@pytest.mark.parametrize("value", ["0", "0,1", "1,0", "GPU-aaaa"])
def test_diagnosis_well_formed_variable_is_no_problem(value):
    assert _diagnose(visible_devices_env=value, device_count=1).problems == ()


def test_diagnosis_no_driver():
    diagnosis = _diagnose(driver_found=False)
    assert not diagnosis.usable
    assert _codes(diagnosis) == ["no_driver"]
    fix = diagnosis.problems[0].fix
    for where in ("Colab", "Kaggle", "driver"):
        assert where in fix


def test_diagnosis_lists_every_problem_most_fundamental_first():
    diagnosis = _diagnose(cuda_build=None, driver_found=False, visible_devices_env="")
    assert _codes(diagnosis) == ["cpu_build", "no_driver", "hidden_by_env"]
    text = str(diagnosis)
    assert text.startswith("CUDA is NOT usable")
    assert text.count("  why: ") == 3 and text.count("  fix: ") == 3


def test_diagnosis_driver_but_no_device():
    diagnosis = _diagnose(cuda_build="13.0")
    assert _codes(diagnosis) == ["no_usable_device"]
    assert "CUDA 13.0" in diagnosis.problems[0].why


def test_diagnose_this_machine_agrees_with_torch():
    diagnosis = d2lgpu.diagnose_this_machine()
    assert diagnosis.usable == (_torch_gpu_count() > 0)
    assert diagnosis.device_count == _torch_gpu_count()
    no_driver = report.read_nvml().error is not None and not Path("/proc/driver/nvidia").exists()
    assert ("no_driver" in _codes(diagnosis)) == (no_driver and not diagnosis.usable)
    assert ("cpu_build" in _codes(diagnosis)) == (torch.version.cuda is None)


def test_diagnose_this_machine_reads_the_variable(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "abc")
    assert "hidden_by_env" in _codes(d2lgpu.diagnose_this_machine())


def test_num_gpus_with_hiding_variable_in_subprocess():
    # The variable must be set before CUDA starts, hence fresh processes (run side by side).
    values = ["abc", ""]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", "import d2lgpu; print(d2lgpu.num_gpus())"],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": value},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for value in values
    ]
    for value, process in zip(values, processes, strict=True):
        try:
            out, err = process.communicate(timeout=120)
        finally:
            process.kill()
        assert process.returncode == 0, f"CUDA_VISIBLE_DEVICES={value!r}: {err}"
        assert out.strip() == "0", f"CUDA_VISIBLE_DEVICES={value!r} left GPUs visible: {out}"


# --- NVML ----------------------------------------------------------------------------------


def test_read_nvml_never_raises_and_is_consistent():
    view = d2lgpu.read_nvml()
    assert isinstance(view, NvmlView)
    if view.error is None:
        assert view.driver_version
        assert len(view.gpus) >= _torch_gpu_count()
    else:
        assert view.gpus == () and view.driver_version is None


def _fake_pynvml(fail_init: bool = False) -> types.ModuleType:
    """A stand-in for pynvml with one GPU whose temperature query is unsupported."""
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 (pynvml's spelling)
        pass

    class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801
        pass

    class NVMLError_NoPermission(NVMLError):  # noqa: N801
        pass

    class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
        pass

    def init():
        if fail_init:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def temperature(handle, sensor):
        raise NVMLError_NotSupported("Not Supported")

    fake.NVMLError = NVMLError
    fake.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    fake.NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    fake.NVMLError_NotSupported = NVMLError_NotSupported
    fake.NVMLError_NoPermission = NVMLError_NoPermission
    fake.NVMLError_GpuIsLost = NVMLError_GpuIsLost
    fake.NVML_TEMPERATURE_GPU = 0
    fake.nvmlInit = init
    fake.nvmlShutdown = lambda: None
    fake.nvmlSystemGetDriverVersion = lambda: "550.54"
    fake.nvmlSystemGetCudaDriverVersion = lambda: 12080
    fake.nvmlDeviceGetCount = lambda: 1
    fake.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    fake.nvmlDeviceGetName = lambda h: "Tesla T4"
    fake.nvmlDeviceGetUUID = lambda h: "GPU-1234"
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=2 * 2**30, total=16 * 2**30, free=14 * 2**30
    )
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37, memory=5)
    fake.nvmlDeviceGetPowerUsage = lambda h: 31_500  # milliwatts
    fake.nvmlDeviceGetEnforcedPowerLimit = lambda h: 70_000
    fake.nvmlDeviceGetTemperature = temperature
    return fake


def test_read_nvml_converts_units_and_tolerates_unsupported_queries(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    view = d2lgpu.read_nvml()
    assert view.error is None and view.driver_version == "550.54"
    (gpu,) = view.gpus
    assert (gpu.name, gpu.uuid, gpu.utilization_percent) == ("Tesla T4", "GPU-1234", 37)
    assert gpu.power_watts == pytest.approx(31.5) and gpu.power_limit_watts == pytest.approx(70)
    assert gpu.memory_used_bytes == 2 * 2**30 and gpu.memory_total_bytes == 16 * 2**30
    assert gpu.temperature_c is None


def test_read_nvml_reads_the_other_gpus_when_one_fails(monkeypatch):
    # Three GPUs: 0 reads, 1 refuses its memory reading (e.g. a GPU of another user in
    # a container), 2 has fallen off the bus. One bad GPU must not hide the others.
    fake = _fake_pynvml()
    memory = fake.nvmlDeviceGetMemoryInfo

    def handle_by_index(i):
        if i == 2:
            raise fake.NVMLError_GpuIsLost("GPU is lost")
        return ("handle", i)

    def memory_info(handle):
        if handle[1] == 1:
            raise fake.NVMLError_NoPermission("Insufficient Permissions")
        return memory(handle)

    fake.nvmlDeviceGetCount = lambda: 3
    fake.nvmlDeviceGetHandleByIndex = handle_by_index
    fake.nvmlDeviceGetMemoryInfo = memory_info
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    view = d2lgpu.read_nvml()
    assert view.error is None and view.driver_version == "550.54"
    assert [g.index for g in view.gpus] == [0, 1, 2]
    ok, no_permission, lost = view.gpus
    assert ok.error is None and ok.memory_total_bytes == 16 * 2**30
    assert ok.temperature_c is None  # merely unsupported: not an error
    assert no_permission.memory_used_bytes is None
    assert no_permission.utilization_percent == 37  # what it may read, it reads
    assert "memory" in no_permission.error and "Insufficient Permissions" in no_permission.error
    assert "GPU is lost" in lost.error and lost.memory_total_bytes is None
    full_report = dataclasses.replace(_report_with(_fake_gpu((8, 0), False)), nvml=view)
    text = d2lgpu.format_report(full_report)
    assert "GPU is lost" in text and "Insufficient Permissions" in text


@pytest.mark.parametrize("refusal", ["NVMLError_NotSupported", "NVMLError_NoPermission"])
def test_nvml_readings_it_refuses_show_as_na_and_never_crash_the_report(monkeypatch, refusal):
    # A GPU (or a container) where NVML refuses every reading, and whose shutdown fails
    # too (NVML already shut down by another library): the report shows "n/a".
    fake = _fake_pynvml()
    error = getattr(fake, refusal)

    def refuse(*args):
        raise error(refusal)

    for query in ("nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo",
                  "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage",
                  "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTemperature",
                  "nvmlShutdown"):
        setattr(fake, query, refuse)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    view = d2lgpu.read_nvml()
    assert view.error is None and view.driver_version == "550.54"
    (gpu,) = view.gpus
    assert gpu.memory_free_bytes is None and gpu.power_watts is None
    line = report.format_nvml_view(view).splitlines()[1]
    assert line == ("nvml:0 ?: utilisation n/a, memory n/a, temperature n/a, power n/a")
    assert (gpu.error is None) == (refusal == "NVMLError_NotSupported")
    # The environment report asks NVML for free memory: unknown, and no crash either.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: _fake_props("T4", 7, 5))
    monkeypatch.setattr(report, "_pycuda_attributes", lambda count: ("no pycuda", [None] * count))
    text = d2lgpu.format_report(d2lgpu.environment_report())
    assert "memory: free unknown" in text and "utilisation n/a" in text


def test_read_nvml_explains_a_missing_driver(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    view = d2lgpu.read_nvml()
    assert view.gpus == ()
    assert "NVML cannot start" in view.error and "no driver" in view.error


# --- the environment report -----------------------------------------------------------------


def test_environment_report_matches_torch():
    env_report = d2lgpu.environment_report()
    assert isinstance(env_report, EnvironmentReport)
    assert env_report.torch_version == torch.__version__
    assert env_report.cuda_build == torch.version.cuda
    assert len(env_report.gpus) == _torch_gpu_count()
    assert env_report.diagnosis.usable == (_torch_gpu_count() > 0)
    if torch.version.cuda is None:
        assert env_report.cudnn_version is None


def test_environment_report_without_pycuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    env_report = d2lgpu.environment_report()
    assert "pycuda is not installed" in env_report.pycuda_status
    assert "pip install pycuda" in env_report.pycuda_status


def _fake_pycuda(monkeypatch) -> None:
    """Stand-ins for pycuda and pycuda.driver: every device reports two attributes."""

    class Attribute:  # pycuda's device_attribute enum prints as its bare name
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return self.name

    class Device:
        def __init__(self, index):
            self.index = index

        def get_attributes(self):
            return {Attribute("WARP_SIZE"): 32, Attribute("MULTIPROCESSOR_COUNT"): 40 + self.index}

    driver = types.ModuleType("pycuda.driver")
    driver.Error = RuntimeError
    driver.init = lambda: None
    driver.Device = Device
    package = types.ModuleType("pycuda")
    package.driver = driver
    monkeypatch.setitem(sys.modules, "pycuda", package)
    monkeypatch.setitem(sys.modules, "pycuda.driver", driver)


def test_pycuda_attributes_per_gpu(monkeypatch):
    _fake_pycuda(monkeypatch)
    status, attributes = report._pycuda_attributes(2)
    assert status == "pycuda is installed"
    assert attributes == [
        {"WARP_SIZE": 32, "MULTIPROCESSOR_COUNT": 40},
        {"WARP_SIZE": 32, "MULTIPROCESSOR_COUNT": 41},
    ]


def test_pycuda_without_gpus(monkeypatch):
    _fake_pycuda(monkeypatch)
    assert report._pycuda_attributes(0) == ("pycuda is installed", [])


def test_format_cudnn_versions():
    assert report._format_cudnn(92400) == "9.24.0"  # cuDNN 9: major*10000 + minor*100 + patch
    assert report._format_cudnn(8902) == "8.9.2"  # cuDNN 8: major*1000 + minor*100 + patch


def _fake_gpu(capability, pycuda_attributes=None) -> GpuInfo:
    return GpuInfo(
        index=0, name="Fake GPU", capability=capability, total_memory_bytes=16 * 2**30,
        free_memory_bytes=15 * 2**30, multiprocessor_count=40,
        native_formats=tuple(d2lgpu.native_tensor_core_formats(capability)),
        uuid="GPU-0", pycuda_attributes=pycuda_attributes,
    )


def _report_with(gpu: GpuInfo) -> EnvironmentReport:
    real = d2lgpu.environment_report()
    return EnvironmentReport(
        python_version=real.python_version, platform=real.platform,
        torch_version=real.torch_version, cuda_build="12.4", cudnn_version="9.1.0",
        nccl_version="2.21.5", visible_devices_env="0", gpus=(gpu,),
        nvml=NvmlView("550.54", (), None), pycuda_status="pycuda is installed",
        diagnosis=diagnose_cuda(cuda_build="12.4", visible_devices_env="0", driver_found=True,
                                device_count=1),
    )


def test_format_report_warns_about_emulated_bf16_on_a_turing_gpu():
    gpu = _fake_gpu((7, 5), pycuda_attributes={"WARP_SIZE": 32, "X": 1})
    text = d2lgpu.format_report(_report_with(gpu))
    assert "compute capability 7.5, 40 SMs" in text
    assert "Tensor Core formats (native): fp16" in text
    assert "bf16 runs emulated" in text
    assert "15.00 GiB free of 16.00 GiB" in text
    assert "pycuda: WARP_SIZE=32" in text and "X=1" not in text
    assert "CUDA_VISIBLE_DEVICES: '0'" in text
    assert "CUDA is usable: 1 GPU(s) visible." in text


def test_format_report_warns_about_bf16_on_a_volta_gpu():
    gpu = _fake_gpu((7, 0))
    text = d2lgpu.format_report(_report_with(gpu))
    assert "no bf16 Tensor Cores on this GPU" in text
    assert "is_bf16_supported() counts emulation as support" in text


def test_format_report_no_warning_on_an_ampere_gpu():
    gpu = _fake_gpu((8, 0))
    text = d2lgpu.format_report(_report_with(gpu))
    assert "fp16, bf16, tf32" in text
    assert "emulated" not in text and "no bf16 Tensor Cores" not in text


def test_format_report_of_this_machine():
    env_report = d2lgpu.environment_report()
    text = d2lgpu.format_report(env_report)
    assert f"torch {torch.__version__}" in text
    assert f"GPUs visible to torch: {_torch_gpu_count()}" in text
    assert text.rstrip().endswith(str(env_report.diagnosis).rstrip())


def test_print_report(capsys):
    d2lgpu.report.print_report()
    assert "-- diagnosis --" in capsys.readouterr().out


def test_print_setup_says_what_runs_where(capsys):
    d2lgpu.print_setup()
    summary = capsys.readouterr().out.rstrip("\n")
    assert f"torch {torch.__version__}" in summary
    assert summary.endswith(d2lgpu.runtime.config.describe_mode())
    if _torch_gpu_count() == 0:
        assert "No CUDA GPU here: everything runs on the CPU" in summary
    else:
        for i in range(_torch_gpu_count()):
            assert f"cuda:{i}  {torch.cuda.get_device_name(i)}" in summary
    assert all(len(line) <= 100 for line in summary.splitlines())


# --- GPU memory -------------------------------------------------------------------------------


def test_gpu_memory_refuses_the_cpu():
    with pytest.raises(ValueError, match="try_gpu"):
        d2lgpu.gpu_memory("cpu")


def test_gpu_memory_refuses_a_missing_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="cuda:99 does not exist: this process sees 1 GPU"):
        d2lgpu.gpu_memory(99)


def test_gpu_memory_without_cuda_says_why(monkeypatch):
    # torch alone says "Found no NVIDIA driver" (or worse, from current_device()).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for device in ("cuda", 0):
        with pytest.raises(RuntimeError, match="gpu_memory was given cuda") as info:
            d2lgpu.gpu_memory(device)
        assert "cannot use CUDA" in str(info.value) and "python -m d2lgpu info" in str(info.value)


@pytest.mark.gpu
def test_gpu_memory_follows_the_caching_allocator():
    device = d2lgpu.gpu(0)
    torch.cuda.empty_cache()
    before = d2lgpu.gpu_memory(device)
    nbytes = 64 * 2**20
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    held = d2lgpu.gpu_memory(device)
    assert held.allocated - before.allocated >= nbytes
    assert held.reserved >= held.allocated
    assert held.peak_allocated >= held.allocated
    assert 0 < held.free <= held.total
    del x
    freed = d2lgpu.gpu_memory(device)
    assert freed.allocated == before.allocated
    assert freed.reserved == held.reserved  # the allocator keeps the block cached
    torch.cuda.empty_cache()
    assert d2lgpu.gpu_memory(device).reserved < held.reserved


# --- on a real GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_environment_report_on_a_gpu():
    env_report = d2lgpu.environment_report()
    assert env_report.diagnosis.usable and env_report.diagnosis.problems == ()
    assert env_report.cuda_build is not None and env_report.cudnn_version is not None
    assert len(env_report.gpus) == torch.cuda.device_count()
    for gpu in env_report.gpus:
        assert gpu.name == torch.cuda.get_device_name(gpu.index) and gpu.name
        assert isinstance(gpu.capability, tuple) and len(gpu.capability) == 2
        assert all(isinstance(part, int) for part in gpu.capability)
        assert gpu.capability == torch.cuda.get_device_capability(gpu.index)
        assert 0 < gpu.free_memory_bytes <= gpu.total_memory_bytes
        assert gpu.multiprocessor_count > 0
        assert list(gpu.native_formats) == d2lgpu.native_tensor_core_formats(gpu.capability)
    assert env_report.nvml.error is None
    assert len(env_report.nvml.gpus) >= len(env_report.gpus)
    text = d2lgpu.format_report(env_report)
    for gpu in env_report.gpus:
        assert f"cuda:{gpu.index}  {gpu.name}" in text


# --- the command line ---------------------------------------------------------------------------


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== d2lgpu environment report ==")
    assert "-- diagnosis --" in out


def test_cli_info_reports_a_bad_setting_instead_of_failing(monkeypatch, capsys):
    monkeypatch.setenv("D2LGPU_QUICK", "maybe")
    assert main(["info"]) == 0
    assert "configuration error: D2LGPU_QUICK='maybe' is not understood" in capsys.readouterr().out


def test_cli_info_json(capsys):
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["torch_version"] == torch.__version__
    assert data["diagnosis"]["usable"] == (_torch_gpu_count() > 0)


def test_cli_require_gpu(capsys):
    expected = 0 if _torch_gpu_count() else 1
    assert main(["info", "--require-gpu"]) == expected


def test_cli_needs_a_command(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: d2lgpu" in err and "a command is required" in err


def test_cli_unknown_command(capsys):
    assert main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert "usage: d2lgpu" in err and "invalid choice: 'bogus'" in err


def test_cli_unknown_option(capsys):
    assert main(["info", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_cli_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"d2lgpu {d2lgpu.__version__}"


def test_python_dash_m_d2lgpu_info():
    result = subprocess.run(
        [sys.executable, "-m", "d2lgpu", "info"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "== d2lgpu environment report ==" in result.stdout
    diagnosis = d2lgpu.diagnose_this_machine()
    assert str(diagnosis) in result.stdout


# --- one unusable GPU, and bad input -------------------------------------------------------


def _fake_props(name: str, major: int, minor: int, **extra):
    return types.SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=40,
                                 total_memory=16 * 10**9, uuid=f"uuid-{name}", **extra)


def _two_fake_gpus(monkeypatch, props, nvml=None):
    """Two GPUs with properties ``props(i)``; NVML's view ``nvml`` (by default, none).
    Creating a CUDA context fails the test: the report reads without."""
    def mem_get_info(*args, **kwargs):
        raise AssertionError("environment_report created a CUDA context")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", mem_get_info)
    monkeypatch.setattr(torch.cuda, "device", mem_get_info)
    monkeypatch.setattr(report, "_pycuda_attributes", lambda count: ("no pycuda", [None] * count))
    monkeypatch.setattr(report, "read_nvml",
                        lambda: nvml or NvmlView(None, (), "NVML cannot start: faked"))


def _nvml_reading(index, uuid, used_gib, total_gib=16):
    return report.NvmlGpuReading(index, f"nvml{index}", uuid, 10, used_gib * 2**30,
                                 total_gib * 2**30, 40, 50.0, 70.0,
                                 memory_free_bytes=(total_gib - used_gib) * 2**30)


def test_environment_report_reads_free_memory_from_nvml_without_a_cuda_context(monkeypatch):
    # NVML lists the GPUs in its own order, with the GPU- prefix; torch's UUIDs match them.
    nvml = NvmlView("580.1", (_nvml_reading(0, "GPU-uuid-GPU1", 4),
                              _nvml_reading(1, "GPU-uuid-GPU0", 1)), None)
    _two_fake_gpus(monkeypatch, lambda i: _fake_props(f"GPU{i}", 7, 5), nvml)
    first, second = d2lgpu.environment_report().gpus
    assert first.free_memory_bytes == 15 * 2**30 and first.total_memory_bytes == 16 * 2**30
    assert second.free_memory_bytes == 12 * 2**30
    assert first.error is None and second.error is None


def test_a_gpu_without_a_uuid_takes_no_other_gpus_free_memory(monkeypatch):
    # An empty UUID is a suffix of every NVML UUID: matching by it would give GPU 0 the free
    # memory of whichever GPU NVML lists last.
    nvml = NvmlView("580.1", (_nvml_reading(0, "GPU-uuid-GPU0", 4),
                              _nvml_reading(1, "GPU-uuid-GPU1", 1)), None)
    def props(i):
        gpu = _fake_props(f"GPU{i}", 7, 5)
        gpu.uuid = "" if i == 0 else gpu.uuid
        return gpu

    _two_fake_gpus(monkeypatch, props, nvml)
    first, second = d2lgpu.environment_report().gpus
    assert first.free_memory_bytes is None and first.total_memory_bytes == 16 * 10**9
    assert second.free_memory_bytes == 15 * 2**30


def test_environment_report_without_nvml_knows_the_total_but_not_the_free_memory(monkeypatch):
    _two_fake_gpus(monkeypatch, lambda i: _fake_props(f"GPU{i}", 8, 0))
    gpu = d2lgpu.environment_report().gpus[0]
    assert gpu.free_memory_bytes is None and gpu.total_memory_bytes == 16 * 10**9
    assert "memory: free unknown, 14.90 GiB in all" in d2lgpu.format_report(
        d2lgpu.environment_report())


def test_environment_report_reports_a_lost_gpu_and_reads_the_other(monkeypatch):
    def props(i):
        if i == 0:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return _fake_props("GPU1", 7, 5)

    _two_fake_gpus(monkeypatch, props)
    env = d2lgpu.environment_report()
    lost, ok = env.gpus
    assert lost.name == "?" and lost.error.startswith("properties: RuntimeError")
    assert ok.name == "GPU1" and ok.native_formats == ("fp16",) and ok.error is None
    text = d2lgpu.format_report(env)
    assert "cuda:0  cannot be read: properties: RuntimeError" in text
    assert "cuda:1  GPU1  (compute capability 7.5, 40 SMs)" in text


@pytest.mark.parametrize(("call", "match"), [
    (lambda: parse_cuda_visible_devices(0), r"write str\(0\)"),
    (lambda: diagnose_cuda(cuda_build=None, visible_devices_env=0, driver_found=True,
                           device_count=0), r"write str\(0\)"),
    (lambda: report.gpu_memory(None), "use 'cpu', 'cuda'"),
])
def test_report_functions_name_the_fix_for_bad_input(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


# --- your GPU in numbers -----------------------------------------------------------------


def test_gpu_in_numbers_reads_what_the_properties_have():
    # torch 2.15's properties of a T4 (figures as CUDA reports them for that board)
    t4 = _fake_props("Tesla T4", 7, 5, warp_size=32, max_threads_per_multi_processor=1024,
                     regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=65536,
                     L2_cache_size=4 * 2**20, memory_clock_rate=5_001_000, memory_bus_width=256)
    numbers = report.device_numbers(t4)
    assert numbers["SMs"] == 40 and numbers["warp size (threads)"] == 32
    assert numbers["shared memory per SM, max"] == "64 KiB"
    assert numbers["memory bandwidth"] == "320 GB/s"  # 2 x 5.001 GHz x 32 bytes
    # where the board's own figures and the data sheet overlap, they agree
    sheet = chips.GPU_DATASHEETS["T4"]
    for key in ("compute capability", "SMs", "warp size (threads)", "max threads per SM",
                "registers per SM (32-bit)", "shared memory per SM, max", "memory bandwidth"):
        assert str(numbers[key]) == str(sheet[key]), key
    table = report.gpu_in_numbers(t4)
    assert table.splitlines()[0].split() == ["yours:", "Tesla", "T4", "H100", "SXM5", "T4"]
    assert len(table.splitlines()) == 2 + len(report.GPU_NUMBERS_ROWS)


def test_gpu_in_numbers_on_an_older_torch_skips_missing_fields():
    # torch 2.9 has no memory_clock_rate / memory_bus_width / max_threads_per_block
    old = _fake_props("Tesla T4", 7, 5, warp_size=32, L2_cache_size=4 * 2**20)
    numbers = report.device_numbers(old)
    assert "memory bandwidth" not in numbers and "registers per SM (32-bit)" not in numbers
    assert numbers["L2 cache"] == "4.2 MB"
    row = next(line for line in report.gpu_in_numbers(old).splitlines()
               if line.startswith("memory bandwidth"))
    assert row.split()[2] == "-"  # yours: not known; then H100, T4 from the data sheets


def test_gpu_in_numbers_without_a_gpu_shows_the_data_sheets():
    table = report.gpu_in_numbers(None)
    assert "yours" not in table and "H100 SXM5" in table
    assert set(chips.GPU_DATASHEETS["H100 SXM5"]) <= set(report.GPU_NUMBERS_ROWS)


@pytest.mark.parametrize("value", [0, True, float("nan")])
def test_diagnose_names_a_non_string_visible_devices(value):
    with pytest.raises(TypeError, match="CUDA_VISIBLE_DEVICES value is a string"):
        _diagnose(visible_devices_env=value)


# ------------------------------------------------------------------------------------------
# A driver older than torch's CUDA, and a GPU the build has no kernels for
# ------------------------------------------------------------------------------------------

_CU13_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.15+cu132


@pytest.mark.parametrize("driver, build, cause", [
    ("12.4", "13.0", "driver_too_old"),  # older major version
    ("12.2", "12.6", "driver_too_old"),  # older minor, and CUDA did not start
    ("13.0", "13.0", "no_usable_device"),  # new enough: the cause lies elsewhere
    ("13.1", "12.6", "no_usable_device"),
    (None, "13.0", "no_usable_device"),  # unknown: no claim about the driver
])
def test_diagnose_cuda_names_a_driver_older_than_the_build(driver, build, cause):
    diagnosis = d2lgpu.diagnose_cuda(cuda_build=build, visible_devices_env=None,
                                     driver_found=True, device_count=0,
                                     driver_cuda_version=driver)
    assert not diagnosis.usable and diagnosis.cause == cause
    if cause == "driver_too_old":
        text = str(diagnosis)
        assert f"up to {driver}" in text and f"CUDA {build}" in text
        assert "download.pytorch.org/whl/cu126" in text and "Colab or Kaggle" in text


def test_driver_too_old_comes_after_a_cpu_build_and_a_missing_driver():
    cpu = d2lgpu.diagnose_cuda(cuda_build=None, visible_devices_env=None, driver_found=True,
                               device_count=0, driver_cuda_version="11.4")
    assert cpu.cause == "cpu_build" and "driver_too_old" not in [p.code for p in cpu.problems]


def test_driver_cuda_version_from_nvml(monkeypatch):
    fake = _fake_pynvml()
    fake.nvmlSystemGetCudaDriverVersion = lambda: 12040
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert d2lgpu.read_nvml().cuda_driver_version == "12.4"


def test_diagnose_this_machine_passes_the_nvml_cuda_version(monkeypatch):
    monkeypatch.setattr(report.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(report.torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    view = report.NvmlView("550.54", (), None, "12.4")
    assert d2lgpu.diagnose_this_machine(view).cause == "driver_too_old"


@pytest.mark.parametrize("capability, archs, runs", [
    ((7, 0), _CU13_ARCHS, False),  # V100 on a CUDA 13 build
    ((7, 5), _CU13_ARCHS, True),  # T4
    ((8, 9), _CU13_ARCHS, True),  # L4: sm_86 machine code runs on 8.9
    ((9, 0), ["sm_80", "sm_90a"], True),  # an arch-specific entry still names sm_90
    ((8, 0), ["sm_86"], False),  # machine code runs forward only, never backward
    ((10, 0), ["sm_90", "compute_90"], True),  # PTX is compiled for newer GPUs
    ((8, 0), ["compute_90"], False),
    ((7, 0), ["sm_50", "sm_60", "sm_70", "sm_75"], True),  # a CUDA 12 build
])
def test_build_runs_on_follows_cudas_compatibility_rules(capability, archs, runs):
    assert gpus.build_runs_on(capability, archs) is runs


def test_diagnose_cuda_reports_a_gpu_missing_from_the_arch_list(monkeypatch):
    v100 = d2lgpu.diagnose_cuda(cuda_build="13.0", visible_devices_env=None, driver_found=True,
                                device_count=2, gpu_capabilities=[(7, 5), (7, 0)],
                                arch_list=_CU13_ARCHS)
    # One GPU without kernels makes CUDA unusable for the course, as cuda_usable() decides.
    assert not v100.usable and v100.cause == "arch_missing" and len(v100.problems) == 1
    text = str(v100)
    assert text.startswith("CUDA is NOT usable: it lists 2 GPU(s)")
    assert "cuda:1" in text and "sm_70" in text and "CUDA 13 dropped" in text
    assert "whl/cu126" in text and "CUDA_VISIBLE_DEVICES" in text
    fine = d2lgpu.diagnose_cuda(cuda_build="13.0", visible_devices_env=None, driver_found=True,
                                device_count=1, gpu_capabilities=[(9, 0)], arch_list=_CU13_ARCHS)
    assert fine.usable and fine.cause == "ok"
    # diagnose_this_machine reads the capabilities and the arch list from torch.cuda.
    _fake_gpus_with_kernels(monkeypatch, [(7, 0)], _CU13_ARCHS)
    view = report.NvmlView("580.1", (), None, "13.0")
    assert d2lgpu.diagnose_this_machine(view).cause == "arch_missing"


def test_the_fix_for_a_gpu_below_sm_75_is_a_cu126_wheel_not_any_cuda_12_build():
    # torch 2.15 publishes cu126 and CUDA 13 wheels; only cu126 carries sm_50 to sm_70.
    p100 = d2lgpu.diagnose_cuda(cuda_build="12.8", visible_devices_env=None, driver_found=True,
                                device_count=1, gpu_capabilities=[(6, 0)],
                                arch_list=["sm_75", "sm_80", "sm_86", "sm_90", "sm_100"])
    (problem,) = p100.problems
    assert "whl/cu126" in problem.fix and "not just any CUDA 12 build" in problem.fix
    assert "CUDA 13 dropped" not in problem.why  # a CUDA 12.8 build: not CUDA 13's doing
    rtx = d2lgpu.diagnose_cuda(cuda_build="12.6", visible_devices_env=None, driver_found=True,
                               device_count=1, gpu_capabilities=[(12, 0)],
                               arch_list=["sm_50", "sm_60", "sm_70", "sm_80", "sm_90"])
    assert "cu126" not in rtx.problems[0].fix and "newer CUDA" in rtx.problems[0].fix


def _fake_gpus_with_kernels(monkeypatch, capabilities, arch_list, cuda_build="13.0"):
    """torch as a CUDA ``cuda_build`` build for ``arch_list``, listing GPUs of ``capabilities``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capabilities[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"GPU{i}")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: _fake_props(f"GPU{i}", *capabilities[i]))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    monkeypatch.setattr(report, "_pycuda_attributes", lambda count: ("no pycuda", [None] * count))
    monkeypatch.setattr(report, "read_nvml", lambda: NvmlView("580.1", (), None, "13.0"))
    monkeypatch.setattr(report, "nccl_version", lambda: None)
    monkeypatch.setattr(report, "_cudnn_version", lambda: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("D2LGPU_QUICK", "D2LGPU_FULL", "D2LGPU_SMOKE"):
        monkeypatch.delenv(name, raising=False)


def test_a_p100_without_kernels_falls_back_to_the_cpu_and_the_report_says_why(monkeypatch, capsys):
    _fake_gpus_with_kernels(monkeypatch, [(6, 0)], _CU13_ARCHS)
    assert d2lgpu.workload() == "cpu" and d2lgpu.try_gpu() == torch.device("cpu")
    env = d2lgpu.environment_report()
    assert [gpu.name for gpu in env.gpus] == ["GPU0"]  # listed, though not usable
    assert not env.diagnosis.usable and env.diagnosis.cause == "arch_missing"
    text = d2lgpu.format_report(env)
    assert "cuda:0 has compute capability 6.0 (sm_60)" in text
    assert "course runs on the CPU" in text and "whl/cu126" in text
    d2lgpu.print_setup()
    summary = capsys.readouterr().out
    assert "CUDA lists 1 GPU(s), but this torch cannot use them: everything runs on the CPU, in " \
        "CPU mode; this torch has no kernels for a GPU here." in summary
    assert main(["info", "--require-gpu"]) == 1
    assert "CUDA is NOT usable: it lists 1 GPU(s)" in capsys.readouterr().out


def test_a_t4_with_kernels_is_usable_and_require_gpu_passes(monkeypatch, capsys):
    _fake_gpus_with_kernels(monkeypatch, [(7, 5)], _CU13_ARCHS)
    env = d2lgpu.environment_report()
    assert env.diagnosis.usable and env.diagnosis.cause == "ok"
    assert d2lgpu.workload() == "full" and d2lgpu.try_gpu() == torch.device("cuda", 0)
    assert main(["info", "--require-gpu"]) == 0
