"""torchrun in child processes, shared by the DDP and FSDP tests."""

import os
import sys

# Child processes: one intra-op thread each, so two ranks do not fight over two cores.
# No GPUs: these tests are about gloo, and on a GPU machine the two simulated nodes
# of one host would both claim GPU 0, which NCCL refuses.
CHILD_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "D2LGPU_QUICK": "1",
    "CUDA_VISIBLE_DEVICES": "",
}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def two_node_torchrun(node: int, port: int) -> list[str]:
    """torchrun for one of two pretend machines on this one, one process each."""
    return TORCHRUN + [
        "--nnodes=2",
        f"--node-rank={node}",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-conf=timeout=60",
    ]
