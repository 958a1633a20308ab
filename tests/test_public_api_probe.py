"""Every public function and class of the core modules refuses None where None is not
meant, with a ValueError or TypeError whose message names the parameter.

A probe, not a list of hand-picked cases: the parameters come from each signature,
so a parameter added later without a check fails here.
"""

import inspect

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from d2lgpu import data, fast, models, parallel, plotting, training  # noqa: E402
from d2lgpu.runtime import progress  # noqa: E402

CPU = torch.device("cpu")


def _linear():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def _uint8_pair():
    return torch.zeros(20, 1, 28, 28, dtype=torch.uint8), torch.arange(20) % 10


# A valid call of every public callable; each parameter in it is set to None in turn.
VALID = {
    data.DeviceLoader: lambda: dict(images=torch.zeros(4, 1, 2, 2, dtype=torch.uint8),
                                    labels=torch.zeros(4, dtype=torch.long), batch_size=2,
                                    device="cpu"),
    data.fashion_mnist_on_device: lambda: dict(batch_size=50, device="cpu", quick=True),
    data.fashion_mnist_tensors: lambda: dict(train=False, quick=True),
    data.load_data_fashion_mnist: lambda: dict(batch_size=50, quick=True),
    fast.technique_skip_reason: lambda: dict(technique="channels_last", device=CPU),
    fast.make_sgd: lambda: dict(params=list(_linear().parameters()), lr=0.1, device=CPU),
    fast.compile_model: lambda: dict(net=_linear(), techniques=fast.Techniques(), device=CPU),
    fast.train_fast: lambda: dict(
        net=_linear(), train_iter=data.DeviceLoader(*_uint8_pair(), 10, device=CPU),
        test_iter=data.DeviceLoader(*_uint8_pair(), 10, device=CPU), num_epochs=1, lr=0.1,
        device=CPU, progress=False),
}

NONE_MEANT: set = set()  # (function, parameter) pairs where None means something unannotated
CASES = []
for function, make in VALID.items():
    signature = inspect.signature(function)
    for name in make():
        default = signature.parameters[name].default
        annotation = str(signature.parameters[name].annotation)
        if default is None or "None" in annotation or (function, name) in NONE_MEANT:
            continue
        CASES.append(pytest.param(function, make, name,
                                  id=f"{function.__module__}.{function.__name__}({name}=None)"))


def test_every_public_name_of_the_core_modules_is_probed():
    for module in (data, progress, fast, models, parallel, plotting, training):
        callables = {name for name in module.__all__
                     if callable(getattr(module, name)) and name.islower() or
                     inspect.isclass(getattr(module, name))}
        probed = {f.__name__ for f in VALID if f.__module__ == module.__name__}
        # elapsed_bar has its own test (test_progress); History and Techniques are
        # plain records (Techniques' switches are tested in test_fast); the others take
        # nothing. The loops' parts (an epoch, an evaluation, the loss check, the start, the
        # bar) are called by train and train_fast with arguments already checked: they rely
        # on type hints. train checks what a learner gets wrong (lr, devices, a diverging
        # run; tests/test_training.py) and relies on type hints for the rest.
        exempt = {"elapsed_bar", "History",
                  "Techniques", "fused_sgd_device_types", "tiny_shakespeare", "evaluate_accuracy",
                  "train_epoch", "fast_epoch", "check_epoch_loss", "start_run", "progress_bar",
                  "init_weights", "set_seed", "train", "default_num_workers",
                  "synthetic_regression", "verify_fashion_mnist_file", *parallel.__all__,
                  *models.__all__, *plotting.__all__}
        assert callables - probed - exempt == set(), module.__name__


@pytest.mark.parametrize("function, make, name", CASES)
def test_none_is_refused_with_the_parameters_name(function, make, name):
    kwargs = make()
    kwargs[name] = None
    try:
        with pytest.raises((TypeError, ValueError)) as info:
            function(**kwargs)
    finally:
        plt.close("all")
    assert name in str(info.value), str(info.value)
    assert "NoneType' object" not in str(info.value)  # a bare Python error, not ours
