"""Chapter 7's fast path: the techniques that fill one device, by the names the chapter uses.

:func:`d2lgpu.train` is the loop most learners start from: a CPU ``DataLoader``
decodes and copies every batch, and the GPU waits whenever the host falls behind.
For a data set as small as Fashion-MNIST (47 MB as uint8) that is pure overhead.
The fastest small-image training code (e.g. the CIFAR-10 speed runs) removes it
technique by technique, and :class:`Techniques` names each one as a switch of
:func:`d2lgpu.train`. Chapter 7 writes each one out in plain PyTorch, then turns them
on one at a time in an ablation (:func:`d2lgpu.profiling.run_ablation`):

``device_data``
    The images live on the device as uint8, four times smaller than float32, and
    are converted and normalised there, one batch at a time (:class:`d2lgpu.data.DeviceLoader`).
    Shuffling is a ``torch.randperm`` on the device from a seeded generator; a batch
    is an index into the resident tensors. No worker processes, no host copies.
``no_sync``
    Loss and correct counts are summed in device tensors and read once per epoch,
    so the host queues work far ahead of the GPU (d2l's loop reads them with
    ``.item()`` after every step, which waits for the GPU each time).
``precision``
    Not a switch but a word of :data:`d2lgpu.precision.PRECISIONS` (default ``"fp32"``). The fast
    path's ``"auto"`` runs the forward pass under autocast in the format the device
    runs fast (:func:`d2lgpu.precision_policy`: bf16 from Ampere on, fp16 with loss
    scaling before; on a CPU bf16 where it is native, else fp32).
``channels_last``
    Model and batches in NHWC, the layout of cuDNN's Tensor Core convolutions; on CUDA
    it also turns cuDNN's autotuner on (``torch.backends.cudnn.benchmark``): two changes.
``fused_optimizer``
    One fused SGD kernel updates all parameters (:func:`make_sgd`); it also takes
    GradScaler's inf check on the device, so fp16 needs no host round trip either.
``compile``
    ``torch.compile`` fuses the model's operations into fewer, generated kernels
    (costs seconds to minutes up front and needs a compiler toolchain).
``cuda_graphs``
    The model's kernels are recorded once as a CUDA graph and replayed, one launch
    per graph instead of one per kernel (:func:`compile_model`).

:meth:`Techniques.fast` is the fast path: every technique that pays off on the
device (:func:`technique_skip_reason` says why one does not), with ``compile`` and
``cuda_graphs`` to be asked for.

The loop runs these switches, so their code lives beside it in :mod:`d2lgpu.training`
(a module every chapter from 4 on uses); this module is chapter 7's name for them and
imports only from lower modules.
"""

from __future__ import annotations

from d2lgpu.training import (
    COMPILE_MODES,
    SWITCHES,
    TECHNIQUES,
    Techniques,
    as_device_loader,
    compile_model,
    fused_sgd_device_types,
    make_sgd,
    technique_skip_reason,
    train_fast,
)

__all__ = [
    "COMPILE_MODES",
    "SWITCHES",
    "TECHNIQUES",
    "Techniques",
    "as_device_loader",
    "compile_model",
    "fused_sgd_device_types",
    "make_sgd",
    "technique_skip_reason",
    "train_fast",
]
