"""The notebook header and NVML's readings as text: pure functions, tested on any machine."""

import pytest

from d2lgpu.report import (
    NvmlGpuReading,
    NvmlView,
    diagnose_cuda,
    format_nvml_view,
    format_setup,
    read_nvml_while_busy,
)


def _header(gpus, workload_name="cpu", **facts) -> str:
    known = dict(cuda_build="12.4", visible_devices_env=None, driver_found=True,
                 device_count=len(gpus))
    known.update(facts)
    return format_setup(versions="d2lgpu 0.1.0, torch 2.x", gpus=gpus,
                        diagnosis=diagnose_cuda(**known), workload_name=workload_name,
                        mode_line="the mode line")


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        (dict(driver_found=False), "no NVIDIA driver was found"),
        (dict(cuda_build=None), "this torch is a CPU-only build"),
        (dict(visible_devices_env=""), "CUDA_VISIBLE_DEVICES hides every GPU"),
        ({}, "a driver is present, yet CUDA finds no usable GPU"),
    ],
)
def test_header_without_gpu_says_everything_runs_on_the_cpu_and_why(facts, reason):
    lines = _header([], **facts).splitlines()
    assert lines[0] == "d2lgpu 0.1.0, torch 2.x"
    assert lines[1] == f"No CUDA GPU here: everything runs on the CPU, in CPU mode; {reason}."
    assert "python -m d2lgpu info" in lines[2]
    assert lines[-1] == "the mode line"
    assert "GPUs: 0" not in "\n".join(lines)


def test_header_names_the_workload():
    assert "on the CPU, in quick mode;" in _header([], "quick", driver_found=False)
    assert "on the CPU, in full mode;" in _header([], "full", driver_found=False)


def test_header_with_gpus_counts_and_names_them():
    text = _header([("NVIDIA T4", (7, 5)), ("NVIDIA T4", (7, 5))], "full")
    lines = text.splitlines()
    assert lines[1] == "2 CUDA GPUs here: the chapters run on them, in full mode."
    assert lines[2] == "  cuda:0  NVIDIA T4  (compute capability 7.5)"
    assert lines[3] == "  cuda:1  NVIDIA T4  (compute capability 7.5)"
    assert "note" not in text and "No CUDA GPU" not in text
    one = _header([("NVIDIA H100 80GB HBM3", (9, 0))], "full")
    assert "1 CUDA GPU here:" in one


def test_header_with_gpus_mentions_a_malformed_variable():
    text = _header([("NVIDIA T4", (7, 5))], "full", visible_devices_env="0,,1")
    assert "note: CUDA_VISIBLE_DEVICES is malformed" in text


def _reading(index, uuid, utilisation, power=None, limit=None):
    return NvmlGpuReading(index=index, name="Tesla T4", uuid=uuid,
                          utilization_percent=utilisation, memory_used_bytes=2 * 2**30,
                          memory_total_bytes=16 * 2**30, temperature_c=None,
                          power_watts=power, power_limit_watts=limit)


def test_nvml_view_as_text_marks_the_gpu_by_uuid():
    view = NvmlView("550.54", (_reading(0, "GPU-aaaa", 3), _reading(1, "GPU-bbbb", 100, 68, 70)),
                    None)
    lines = format_nvml_view(view, mark_uuid="bbbb", mark="<- busy").splitlines()
    assert lines[0] == "driver 550.54, 2 GPU(s)"
    assert lines[1] == ("nvml:0 Tesla T4: utilisation 3%, memory 2.0/16.0 GiB, "
                        "temperature n/a, power n/a")
    assert lines[2].endswith("utilisation 100%, memory 2.0/16.0 GiB, temperature n/a, "
                             "power 68 W of 70 W  <- busy")


def test_nvml_view_as_text_gives_the_error_and_marks_nothing_without_a_uuid():
    assert format_nvml_view(NvmlView(None, (), "NVML cannot start: x")) == "NVML cannot start: x"
    view = NvmlView("550.54", (_reading(0, "GPU-aaaa", None),), None)
    text = format_nvml_view(view)
    assert "utilisation n/a" in text and "<-" not in text


def test_read_nvml_while_busy_refuses_the_cpu():
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        read_nvml_while_busy("cpu")


@pytest.mark.gpu
def test_read_nvml_while_busy_sees_the_gpu_working():
    import torch

    view = read_nvml_while_busy(0, busy_seconds=2.0, matrix_size=4096)
    if view.error is not None:
        pytest.skip(f"NVML is not usable here: {view.error}")
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    (ours,) = [r for r in view.gpus if r.uuid.endswith(uuid)]
    assert ours.utilization_percent is not None and ours.utilization_percent >= 50


def test_wrapped_keeps_lines_within_the_width_and_indents_continuations():
    from d2lgpu.report import wrapped

    diagnosis = str(diagnose_cuda(cuda_build=None, visible_devices_env=None,
                                  driver_found=False, device_count=0))
    text = wrapped(diagnosis, width=60)
    assert all(len(line) <= 60 for line in text.splitlines())
    assert text.split() == diagnosis.split()  # same words, same order
    assert any(line.startswith("      ") for line in text.splitlines())  # "  " + 4
    assert wrapped("short\n\n  also short") == "short\n\n  also short"
