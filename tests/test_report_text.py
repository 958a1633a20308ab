"""The notebook header and NVML's readings as text: pure functions, tested on any machine."""

import pytest

from d2lgpu.report import (
    NvmlGpuReading,
    NvmlView,
    format_nvml_view,
    print_setup,
    read_nvml_while_busy,
)
from d2lgpu.runtime.config import describe_mode


def _summary(monkeypatch, capsys, gpus, cuda_build="12.4", listed=None, workload="cpu"):
    """print_setup's lines on a made-up machine: ``gpus`` usable, ``listed`` seen by CUDA."""
    from d2lgpu import report
    from d2lgpu.runtime import config

    monkeypatch.setattr(report, "num_gpus", lambda: len(gpus))
    monkeypatch.setattr(report.torch.version, "cuda", cuda_build)
    monkeypatch.setattr(report.torch.cuda, "device_count",
                        lambda: len(gpus) if listed is None else listed)
    monkeypatch.setattr(report.torch.cuda, "get_device_name", lambda i: gpus[i][0])
    monkeypatch.setattr(report.torch.cuda, "get_device_capability", lambda i: gpus[i][1])
    monkeypatch.setattr(config, "workload", lambda cuda=None: workload)
    print_setup()
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(("facts", "reason"), [
    (dict(cuda_build=None), "this torch is a CPU-only build."),
    ({}, "CUDA finds no usable GPU."),
])
def test_header_without_gpu_says_everything_runs_on_the_cpu_and_why(monkeypatch, capsys, facts,
                                                                     reason):
    lines = _summary(monkeypatch, capsys, [], **facts)
    assert lines[0].startswith("d2lgpu ") and ", torch " in lines[0]
    assert lines[1] == f"No CUDA GPU here: everything runs on the CPU, in CPU mode; {reason}"
    assert "python -m d2lgpu info" in lines[2]
    assert lines[-1] == describe_mode()


def test_header_names_gpus_it_cannot_use(monkeypatch, capsys):
    lines = _summary(monkeypatch, capsys, [], listed=2, workload="quick")
    assert lines[1].startswith("CUDA lists 2 GPU(s), but this torch cannot use them")
    assert "in quick mode; this torch has no kernels" in lines[1]


def test_header_with_gpus_counts_and_names_them(monkeypatch, capsys):
    lines = _summary(monkeypatch, capsys, [("NVIDIA T4", (7, 5)), ("NVIDIA T4", (7, 5))],
                     workload="full")
    assert lines[1] == "2 CUDA GPUs here: the chapters run on them, in full mode."
    assert lines[2] == "  cuda:0  NVIDIA T4  (compute capability 7.5)"
    assert lines[3] == "  cuda:1  NVIDIA T4  (compute capability 7.5)"
    assert "No CUDA GPU" not in "\n".join(lines)
    one = _summary(monkeypatch, capsys, [("NVIDIA H100 80GB HBM3", (9, 0))], workload="full")
    assert one[1] == "1 CUDA GPU here: the chapters run on them, in full mode."


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

    view = read_nvml_while_busy(0)
    if view.error is not None:
        pytest.skip(f"NVML is not usable here: {view.error}")
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    (ours,) = [r for r in view.gpus if r.uuid.endswith(uuid)]
    assert ours.utilization_percent is not None and ours.utilization_percent >= 50


def test_wrapped_keeps_lines_within_the_width_and_indents_continuations():
    from d2lgpu.report import diagnose_cuda, wrapped

    diagnosis = str(diagnose_cuda(cuda_build=None, visible_devices_env=None,
                                  driver_found=False, device_count=0))
    text = wrapped(diagnosis, width=60)
    assert all(len(line) <= 60 for line in text.splitlines())
    assert text.split() == diagnosis.split()  # same words, same order
    assert any(line.startswith("      ") for line in text.splitlines())  # "  " + 4
    assert wrapped("short\n\n  also short") == "short\n\n  also short"
