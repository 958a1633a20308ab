"""Test-session setup shared by the unit tests and nbval.

Notebook kernels and the ranks the tests start inherit this process's environment, so
setting the variables here puts every notebook in quick mode (unless smoke mode is asked
for), points it at the offline data, and gives each process one OpenMP thread.
"""

import os
from pathlib import Path

# Smoke mode (D2LGPU_SMOKE=1, full mode's code with the work cut; .ci/run runs every notebook
# in it) must not be overridden by quick mode, which wins over it.
if os.environ.get("D2LGPU_SMOKE", "").strip().lower() not in {"1", "true", "yes", "on"}:
    os.environ.setdefault("D2LGPU_QUICK", "1")
# pytest runs in three worker processes (pyproject.toml's addopts), each starting kernels and
# ranks of its own: with one OpenMP thread each they share the cores instead of
# oversubscribing them (two workers with two threads each took 40 % more CPU time).
os.environ.setdefault("OMP_NUM_THREADS", "1")

_shared_data = Path(__file__).resolve().parent.parent / "shared" / "data"
if "D2LGPU_DATA" not in os.environ and (_shared_data / "FashionMNIST" / "raw").is_dir():
    os.environ["D2LGPU_DATA"] = str(_shared_data)
