"""Test-session setup shared by the unit tests and nbval.

Notebook kernels and the ranks the tests start inherit this process's environment, so
setting the variables here puts every notebook in quick mode (unless smoke mode is asked
for), points it at the offline data, and gives each process one OpenMP thread.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import nbval.kernel
import pytest
import zmq
from jupyter_client.manager import KernelManager

# Smoke mode (D2LGPU_SMOKE=1, full mode's code with the work cut; .ci/run runs every notebook
# in it) must not be overridden by quick mode, which wins over it.
SMOKE = os.environ.get("D2LGPU_SMOKE", "").strip().lower() in {"1", "true", "yes", "on"}
_QUICK_GIVEN = os.environ.get("D2LGPU_QUICK")
if not SMOKE:
    os.environ.setdefault("D2LGPU_QUICK", "1")
# pytest runs in three worker processes (pyproject.toml's addopts), each starting kernels and
# ranks of its own: with one OpenMP thread each they share the cores instead of
# oversubscribing them (two workers with two threads each took 40 % more CPU time).
os.environ.setdefault("OMP_NUM_THREADS", "1")

_shared_data = Path(__file__).resolve().parent.parent / "shared" / "data"
if "D2LGPU_DATA" not in os.environ and (_shared_data / "FashionMNIST" / "raw").is_dir():
    os.environ["D2LGPU_DATA"] = str(_shared_data)


# nbval's kernels talk to pytest over Unix sockets instead of TCP ports. jupyter_client
# picks a kernel's five ports by binding to port 0 and closing again; the kernel binds them
# a second later. Meanwhile the other workers' ranks open gloo and TCPStore connections,
# whose outgoing ports come from the same ephemeral range. One CI run lost chapter 10's
# kernel at its start ("Kernel died before replying to kernel_info"), most likely to that
# race: zmq's "Address already in use" would go to the kernel's stderr, which nbval
# discards, so the run could not say. A socket file in a folder of this process's own
# cannot be taken by another process. zmq has no such sockets on Windows, which keeps TCP.
_KERNEL_SOCKETS = tempfile.mkdtemp(prefix="nbval-kernels-")
atexit.register(shutil.rmtree, _KERNEL_SOCKETS, ignore_errors=True)


class UnixSocketKernelManager(KernelManager):
    def __init__(self, **kwargs):
        folder = tempfile.mkdtemp(dir=_KERNEL_SOCKETS)
        # The sockets are files named <ip>-<n>: an absolute path, since the kernel runs in
        # the notebook's folder and pytest in the repository's.
        super().__init__(transport="ipc", ip=os.path.join(folder, "kernel"), **kwargs)


if zmq.has("ipc"):
    nbval.kernel.KernelManager = UnixSocketKernelManager


#: A notebook cell whose checked output states what its workload did (how many images, steps
#: or batches; whether the model learned) and so differs in smoke mode, where the work is cut
#: below what the statement needs: nbval runs it there but does not compare its output.
SMOKE_IGNORE_TAG = "nbval-ignore-output-in-smoke"

#: The files whose tests take longest, longest first, handed to the workers before the rest
#: (pyproject.toml turns xdist's own order, by number of tests, off): a notebook's cells run
#: in one worker, and chapter 5's 170 s started last would end the run alone. Seconds of
#: test time in quick mode on a 2-core Intel Xeon with torch 2.15, three workers:
#: 171, 111, 82, 62, 56, 42, 40, 37, 24, 23, 23, 21.
SLOWEST_FIRST = (
    "notebooks/05_distributed_data_parallel.ipynb",
    "notebooks/09_model_parallelism.ipynb",
    "notebooks/10_small_gpt.ipynb",
    "notebooks/08_memory_and_sharding.ipynb",
    "tests/test_distributed_faults.py",
    "notebooks/07_profiling_and_compile.ipynb",
    "tests/test_first_gpu_run.py",
    "tests/test_model_parallel_train.py",
    "tests/test_distributed.py",
    "notebooks/01_cuda_checks.ipynb",
    "tests/test_profiling.py",
    "notebooks/04_multi_gpu_concise.ipynb",
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # In a smoke run (D2LGPU_SMOKE=1 pytest) only the notebooks run in smoke mode. A notebook's
    # kernel starts at its first cell's setup, which comes after this hook, and inherits the
    # variables; the unit tests, and the module fixtures set up with their first test, choose
    # their mode themselves (quick, unless a test sets another).
    if not SMOKE:
        return
    if item.nodeid.split("::", 1)[0].endswith(".ipynb"):
        os.environ["D2LGPU_SMOKE"] = "1"
        if _QUICK_GIVEN is None:
            os.environ.pop("D2LGPU_QUICK", None)
        else:
            os.environ["D2LGPU_QUICK"] = _QUICK_GIVEN
    else:
        os.environ.pop("D2LGPU_SMOKE", None)
        os.environ.setdefault("D2LGPU_QUICK", "1")


#: The solution notebooks run with the slow tests: in CI's second part, on the floor torch in
#: smoke mode with their outputs compared. They repeat their chapters' setup (about 90 s of
#: test time together), and the README command had come within 2 s of its 6 minutes.
SLOW_FOLDERS = ("notebooks/solutions/",)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW_FOLDERS):
            item.add_marker(pytest.mark.slow)
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    # A stable sort: the tests of one file, and a notebook's cells, keep their order.
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
    if not SMOKE:
        return
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's items carry their notebook cell
        if cell is not None and SMOKE_IGNORE_TAG in cell.get("metadata", {}).get("tags", []):
            item.options["check"] = False
