"""The runtime: what the chapters' helpers stand on, and a learner need not read.

- ``checks``: the argument checks that name the fix, for what a learner or a command
  line hands the package;
- ``config``: the workload modes (quick, CPU, full, smoke) and where data lives;
- ``gpus``: what CUDA can use in this process, and the NCCL peer-to-peer decision;
- ``distributed``: process groups, the launcher, rendezvous and fault reports;
- ``checkpoints``: distributed checkpoints with checksums, and resuming from them;
- ``cli``: the flags the command-line entry points share;
- ``progress``: the elapsed-time bar of a cell that waits on other processes.

The rule (tests/test_import_graph.py): the runtime never imports a lesson module, and a
lesson module imports only the public names (``__all__``) of these modules.
"""
