"""benchmarks/first_gpu_run.sh: its limits fit the GPU budget, and its CPU rehearsal works."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Each test starts processes (ranks, torchrun, scripts): `pytest` leaves them out, CI runs
# them (pyproject.toml's "slow" marker).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "first_gpu_run.sh"

#: The run must end within 7 minutes on one GPU (of about 15 minutes of device time in
#: all, the machine's start and a possible rerun included).
BUDGET_S = 7 * 60


def _limits() -> dict[str, int]:
    text = SCRIPT.read_text()
    limits = {name: int(limit) for name, limit in re.findall(r"^run_step (\S+) (\d+) ", text, re.M)}
    limits.update(("smoke", int(limit)) for limit in re.findall(r"^smoke (\d+)$", text, re.M))
    return limits


def test_the_steps_and_their_limits_fit_seven_minutes():
    limits = _limits()
    assert list(limits) == ["info", "gpu-tests", "P1", "P2", "P3", "smoke"]
    assert sum(limits.values()) <= BUDGET_S


def test_without_cuda_and_without_rehearse_it_refuses_at_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REHEARSE"}
    env.update(OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "no usable CUDA GPU" in done.stderr and "REHEARSE=1" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing run, nothing written


def test_the_cpu_rehearsal_runs_every_step_and_writes_at_most_eight_files(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), REHEARSE="1", CUDA_VISIBLE_DEVICES="")
    # The script calls python3: this interpreter's, also where its environment is not activated.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    summary = (tmp_path / "summary.md").read_text()
    assert done.returncode == 0, summary + done.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in tmp_path.iterdir()), files
    assert "Rehearsal" in summary
    for step in ("info", "gpu-tests", "smoke", "P1", "P2", "P3"):
        assert re.search(rf"^\| {re.escape(step)} \| ok \| \d+ \| \d+ \|", summary, re.M), step
    # The smoke report lists the notebook it ran, with no failure.
    assert re.search(r"^\| 01_cuda_checks_solutions\.ipynb \| \d+ \| \[\d+\] \| 0 \|", summary,
                     re.M)
    # Each benchmark printed its table into the summary.
    assert "d2l-style" in summary and "train_fast" in summary  # P1
    assert "copy bandwidth" in summary  # P2
    assert "fp32" in summary and "MLP" in summary  # P3
