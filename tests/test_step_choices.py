"""benchmarks/step_choices.py times each row under its precision policy's TF32 setting."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import d2lgpu

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "step_choices.py"


@pytest.fixture(scope="module")
def step_choices():
    spec = importlib.util.spec_from_file_location("step_choices", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.usefixtures("restore_matmul_settings")
@pytest.mark.parametrize(("precision", "tf32"), [("fp32", False), ("tf32", True)])
def test_a_cuda_policy_sets_tf32_for_matmuls_and_convolutions_while_timing(
    step_choices, precision, tf32
):
    # A CUDA policy on a machine without a GPU: the flags are process state, so the step
    # (run on the CPU) sees what a GPU step would. cuDNN allows TF32 by default; "fp32"
    # must switch it off.
    torch.backends.cudnn.allow_tf32 = not tf32
    torch.set_float32_matmul_precision("high" if not tf32 else "highest")
    seen = []

    def step():
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32))

    policy = d2lgpu.precision_policy("cuda", precision)
    step_choices.time_choice(step, policy, torch.device("cpu"), repeats=2)
    assert set(seen) == {("high" if tf32 else "highest", tf32)}
    assert torch.backends.cudnn.allow_tf32 is (not tf32)  # restored afterwards


def test_every_row_of_the_script_goes_through_its_policy(step_choices, monkeypatch, capsys):
    entered = []
    real = d2lgpu.PrecisionPolicy.matmul_precision

    def spy(self):
        entered.append(self.name)
        return real(self)

    monkeypatch.setattr(d2lgpu.PrecisionPolicy, "matmul_precision", spy)
    monkeypatch.setattr(sys, "argv", ["step_choices.py", "--model", "small_cnn",
                                      "--batch-size", "4", "--repeats", "1", "--device", "cpu"])
    step_choices.main()
    auto = d2lgpu.precision_policy("cpu").name
    assert entered == ["fp32", auto, "fp32", auto]
    assert capsys.readouterr().out.count("channels_last") == 2
