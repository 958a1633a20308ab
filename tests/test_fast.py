"""Tests of the fast path: the device-resident loader, the technique switches, fused SGD,
train_fast."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import pytest
import torch
from torch import nn

import d2lgpu
from d2lgpu.data import (
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    DeviceLoader,
    fashion_mnist_on_device,
)
from d2lgpu.fast import make_sgd, train_fast
from d2lgpu.precision import precision_policy

CPU = torch.device("cpu")
U8 = torch.uint8
INT = torch.int64


def indexed_data(n: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images whose pixels hold ``i % 256`` and labels ``i``: every example identifiable."""
    labels = torch.arange(n)
    images = (labels % 256).to(torch.uint8).reshape(n, 1, 1, 1).expand(n, 1, size, size)
    return images.contiguous(), labels


def epoch_labels(loader: DeviceLoader) -> list[torch.Tensor]:
    return [y for _, y in loader]


# --------------------------------------------------------------------------- #
# DeviceLoader
# --------------------------------------------------------------------------- #


def test_each_epoch_is_a_permutation_with_an_explicit_last_batch():
    images, labels = indexed_data(103)
    loader = DeviceLoader(images, labels, 10, device=CPU, shuffle=True, seed=3)
    assert len(loader) == 11 and loader.num_examples == 103
    for _ in range(2):
        batches = list(loader)
        assert [X.shape[0] for X, _ in batches] == [10] * 10 + [3]
        assert all(X.shape[1:] == (1, 4, 4) and X.dtype == torch.float32 for X, _ in batches)
        seen = torch.cat([y for _, y in batches])
        assert torch.equal(seen.sort().values, torch.arange(103))
        # Each image travels with its own label.
        for X, y in batches:
            expected = loader.normalize(images[y])
            assert torch.equal(X, expected)


def test_shuffling_is_seeded_and_differs_between_epochs():
    images, labels = indexed_data(200)

    def orders(seed: int, epochs: int = 2) -> list[torch.Tensor]:
        loader = DeviceLoader(images, labels, 64, device=CPU, shuffle=True, seed=seed)
        return [torch.cat(epoch_labels(loader)) for _ in range(epochs)]

    first, second = orders(5), orders(5)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not torch.equal(first[0], first[1])  # a new permutation every epoch
    assert not torch.equal(first[0], orders(6)[0])
    # manual_seed restarts the sequence.
    loader = DeviceLoader(images, labels, 64, device=CPU, shuffle=True, seed=0)
    list(loader)
    loader.manual_seed(5)
    assert torch.equal(torch.cat(epoch_labels(loader)), first[0])


def test_without_shuffle_batches_come_in_order():
    images, labels = indexed_data(50)
    loader = DeviceLoader(images, labels, 16, device=CPU)
    assert torch.equal(torch.cat(epoch_labels(loader)), torch.arange(50))


def test_normalisation_values_and_uint8_storage():
    values = torch.tensor([0, 51, 128, 255], dtype=torch.uint8)
    images = values.reshape(4, 1, 1, 1).expand(4, 1, 2, 2).contiguous()
    loader = DeviceLoader(images, torch.arange(4), 4, device=CPU)
    assert loader.images.dtype == torch.uint8 and loader.images.device == CPU
    (X, _), = list(loader)
    expected = (values.double() / 255 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    torch.testing.assert_close(X[:, 0, 0, 0].double(), expected, rtol=0, atol=1e-6)
    assert loader.images.dtype == torch.uint8  # batches are converted, the store is not


def test_default_statistics_are_those_of_fashion_mnist():
    # The constants must be the real statistics of the training set: recompute them
    # exactly from a histogram of the 47 million pixel values.
    images, _ = d2lgpu.fashion_mnist_tensors(train=True, quick=False)
    counts = torch.bincount(images.flatten(), minlength=256).double()
    values = torch.arange(256, dtype=torch.float64) / 255
    mean = (counts * values).sum() / counts.sum()
    std = ((counts * (values - mean) ** 2).sum() / (counts.sum() - 1)).sqrt()
    assert abs(mean.item() - FASHION_MNIST_MEAN) < 1e-4
    assert abs(std.item() - FASHION_MNIST_STD) < 1e-4
    # So the quick subset, standardised with them, is centred and of unit spread.
    train_loader, _ = fashion_mnist_on_device(d2lgpu.data.QUICK_TRAIN_SIZE, CPU, quick=True)
    (X, _), = list(train_loader)
    assert abs(X.mean().item()) < 0.05 and abs(X.std().item() - 1) < 0.05


def test_channels_last_batches():
    images = torch.zeros(4, 3, 5, 5, dtype=torch.uint8)
    loader = DeviceLoader(images, torch.zeros(4, dtype=torch.int64), 2, device=CPU,
                          channels_last=True)
    for X, _ in loader:
        assert X.is_contiguous(memory_format=torch.channels_last)
        assert not X.is_contiguous()


@pytest.mark.parametrize(
    "images, labels, message",
    [
        (torch.zeros(4, 1, 2, 2), torch.zeros(4, dtype=INT), "uint8"),
        (torch.zeros(4, 2, 2, dtype=U8), torch.zeros(4, dtype=INT), "unsqueeze"),
        (torch.zeros(4, 1, 2, 2, dtype=U8), torch.zeros(3, dtype=INT), "match"),
        (torch.zeros(4, 1, 2, 2, dtype=U8), torch.zeros(4), "integers"),
    ],
)
def test_bad_loader_input_is_a_clear_error(images, labels, message):
    with pytest.raises(ValueError, match=message):
        DeviceLoader(images, labels, 2, device=CPU)


@pytest.mark.parametrize("test_batch_size", [0, -5, 2.5])
def test_fashion_mnist_on_device_rejects_a_bad_test_batch_size(test_batch_size):
    with pytest.raises(ValueError, match="test_batch_size"):
        fashion_mnist_on_device(64, CPU, quick=True, test_batch_size=test_batch_size)


def _no_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_cuda_without_a_gpu_says_why(monkeypatch):
    _no_cuda(monkeypatch)
    images, labels = indexed_data(4)
    with pytest.raises(RuntimeError, match="DeviceLoader was given cuda") as info:
        DeviceLoader(images, labels, 2, device="cuda")
    assert "cannot use CUDA" in str(info.value) and "try_gpu" in str(info.value)
    with pytest.raises(RuntimeError, match="(?s)peak_tflops was given cuda:0.*d2lgpu info"):
        d2lgpu.peak_tflops("cuda:0")


def test_bad_batch_size_and_seed():
    images, labels = indexed_data(4)
    with pytest.raises(ValueError, match="batch_size"):
        DeviceLoader(images, labels, 0, device=CPU)
    with pytest.raises(ValueError, match="seed"):
        DeviceLoader(images, labels, 2, device=CPU, seed=-1)


def test_fashion_mnist_on_device_quick_subset():
    train_loader, test_loader = fashion_mnist_on_device(64, CPU, quick=True)
    assert train_loader.shuffle and not test_loader.shuffle
    assert train_loader.num_examples == d2lgpu.data.QUICK_TRAIN_SIZE
    assert test_loader.num_examples == d2lgpu.data.QUICK_TEST_SIZE
    assert test_loader.batch_size >= 1024
    X, y = next(iter(train_loader))
    assert X.shape == (64, 1, 28, 28) and y.dtype == torch.int64


# --------------------------------------------------------------------------- #
# Precision, optimizer, FLOPs, peaks
# --------------------------------------------------------------------------- #


def test_auto_precision_on_cpu_is_bf16_only_where_native(monkeypatch):
    # One rule for "auto" everywhere: precision_policy, which the fast path uses too.
    import d2lgpu.precision as precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert precision_policy(CPU, "auto").dtype is None
    assert precision_policy(CPU, "bf16").dtype == torch.bfloat16  # forcing still works
    assert d2lgpu.Techniques.fast(CPU).precision == "fp32"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision_policy(CPU, "auto").dtype == torch.bfloat16
    assert precision_policy(CPU, "fp32").dtype is None
    assert d2lgpu.Techniques.fast(CPU).precision == "auto"


def test_make_sgd_is_fused_here_and_matches_plain_sgd():
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    reference = copy.deepcopy(net)
    fast_opt = make_sgd(net.parameters(), 0.1, CPU)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1, foreach=False)
    assert fast_opt.defaults["fused"]  # torch >= 2.4 has fused SGD on the CPU
    X = torch.randn(8, 5)
    for _ in range(3):
        for model, opt in ((net, fast_opt), (reference, plain_opt)):
            opt.zero_grad()
            model(X).square().sum().backward()
            opt.step()
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- #
# train_fast
# --------------------------------------------------------------------------- #


def test_train_fast_keeps_the_accuracy_of_the_plain_loop():
    # Same model, seed, epochs, batch and learning rate; only the path differs
    # (device loader with standardised inputs, fused SGD). Small data and BN running
    # statistics make single-run accuracies noisy, hence the generous margins.
    epochs, batch, lr = 3, 64, 0.1
    train_iter, test_iter = d2lgpu.load_data_fashion_mnist(batch, quick=True)
    plain = d2lgpu.train(d2lgpu.small_cnn(), train_iter, test_iter, epochs, lr, CPU,
                         seed=0, progress=False)
    train_loader, test_loader = fashion_mnist_on_device(batch, CPU, quick=True)
    fast = train_fast(d2lgpu.small_cnn(), train_loader, test_loader, epochs, lr, CPU,
                      seed=0, progress=False)
    assert fast.num_epochs == plain.num_epochs == epochs
    assert fast.device == "cpu"
    for history in (plain, fast):
        assert history.train_acc[-1] > 0.6 and history.test_acc[-1] > 0.4  # chance is 0.1
        assert history.train_loss[-1] < history.train_loss[0]
    assert abs(fast.train_acc[-1] - plain.train_acc[-1]) < 0.1
    assert fast.test_acc[-1] > plain.test_acc[-1] - 0.1


def test_train_fast_is_reproducible_under_a_seed():
    train_iter, test_iter = fashion_mnist_on_device(128, CPU, quick=True)
    runs = [train_fast(d2lgpu.small_cnn(), train_iter, test_iter, 1, 0.1, CPU, seed=7,
                       progress=False) for _ in range(2)]
    assert runs[0].train_loss == runs[1].train_loss  # the loader's shuffling restarts too
    assert runs[0].test_acc == runs[1].test_acc
    assert runs[0].examples_per_second[0] > 0


def test_train_fast_names_an_empty_training_set_a_generator_hid():
    loader = DeviceLoader(*indexed_data(20), 10, device=CPU)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 20))
    with pytest.raises(ValueError, match="train_iter gave no batches"):
        train_fast(net, (batch for batch in []), loader, 1, 0.1, CPU, progress=False,
                   techniques=Techniques(device_data=True))


def test_train_fast_rejects_a_dataloader_and_names_the_fix():
    train_iter, test_iter = d2lgpu.load_data_fashion_mnist(64, quick=True)
    with pytest.raises(TypeError, match="fashion_mnist_on_device"):
        train_fast(d2lgpu.small_cnn(), train_iter, test_iter, 1, 0.1, CPU, progress=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"num_epochs": 0}, "num_epochs"), ({"lr": 0.0}, "lr"),
     ({"techniques": "fast"}, "techniques must be a d2lgpu.Techniques"),
     ({"device": "meta"}, "'meta' devices"),
     ({"device": ["cpu", "cpu"]}, r"\[.cpu., .cpu.\] is not a device")],
)
def test_train_fast_bad_arguments(kwargs, message):
    loader = DeviceLoader(*indexed_data(20), 10, device=CPU)
    args = dict(num_epochs=1, lr=0.1, device=CPU, progress=False) | kwargs
    with pytest.raises((TypeError, ValueError), match=message):
        train_fast(nn.Sequential(nn.Flatten(), nn.Linear(16, 20)), loader, loader, **args)


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="torch.compile on the CPU needs a C++ compiler; this machine has none",
)
@pytest.mark.slow  # inductor compiles C++ for each graph: about 40 s with a cold cache
def test_compiled_fast_path_matches_eager():
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (256, 1, 8, 8), dtype=torch.uint8, generator=generator)
    labels = (images.float().mean(dim=(1, 2, 3)) > 127).long()

    def run(compile: bool):
        net = nn.Sequential(nn.Flatten(), nn.Linear(64, 2))
        loader = DeviceLoader(images, labels, 64, device=CPU, shuffle=True)
        techniques = dataclasses.replace(Techniques.fast(CPU, compile=compile), precision="fp32")
        return train_fast(net, loader, loader, 2, 0.1, CPU, techniques=techniques,
                          progress=False)

    compiled, eager = run(True), run(False)
    assert compiled.train_loss == pytest.approx(eager.train_loss, rel=1e-4)
    assert compiled.test_acc == eager.test_acc


# --------------------------------------------------------------------------- #
# GPU
# --------------------------------------------------------------------------- #


@pytest.mark.gpu
def test_gpu_loader_keeps_uint8_on_the_gpu_and_shuffles_there():
    device = torch.device("cuda", 0)
    images, labels = indexed_data(300)
    loader = DeviceLoader(images, labels, 64, device=device, shuffle=True, seed=1)
    again = DeviceLoader(images, labels, 64, device=device, shuffle=True, seed=1)
    assert loader.images.device == device and loader.images.dtype == torch.uint8
    batches = list(loader)
    assert all(X.device == device and y.device == device for X, y in batches)
    seen = torch.cat([y for _, y in batches])
    assert torch.equal(seen.sort().values.cpu(), torch.arange(300))
    assert torch.equal(seen, torch.cat([y for _, y in again]))


@pytest.mark.gpu
def test_gpu_training_steps_never_synchronise_with_the_host():
    device = torch.device("cuda", 0)
    train_loader, _ = fashion_mnist_on_device(64, device, quick=True)
    net = d2lgpu.small_cnn().to(device, memory_format=torch.channels_last)
    policy = precision_policy(device, "auto")
    scaler = policy.make_scaler()
    optimizer = make_sgd(net.parameters(), 0.1, device)
    assert optimizer.defaults["fused"]
    loss_sum = torch.zeros((), device=device)
    # torch raises on any operation that waits for the GPU (e.g. .item(), a
    # data-dependent shape, a GradScaler inf check on the host).
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for X, y in train_loader:
            optimizer.zero_grad(set_to_none=True)
            with policy.autocast():
                loss = nn.functional.cross_entropy(net(X), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach().float()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss_sum).item()


@pytest.mark.gpu
def test_gpu_train_fast_learns_in_channels_last_and_reduced_precision():
    device = torch.device("cuda", 0)
    train_loader, test_loader = fashion_mnist_on_device(64, device, quick=True)
    net = d2lgpu.small_cnn()
    history = train_fast(net, train_loader, test_loader, 4, 0.1, device, progress=False)
    assert history.device == str(device)
    assert history.test_acc[-1] > 0.4
    assert precision_policy(device).dtype in (torch.bfloat16, torch.float16)
    # A one-channel weight is contiguous in both layouts: look at a conv with several inputs.
    conv = next(m for m in net.modules() if isinstance(m, nn.Conv2d) and m.in_channels > 1)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_train_fast_without_switches_is_chapter_4s_train():
    # Techniques() switches everything off but no_sync, which chapter 4's train does too: on
    # the CPU a seed gives bit-identical runs, so both loops must give the same history.
    _, dataloaders = tiny_data()
    plain = d2lgpu.train(conv_net(), *dataloaders, 2, 0.1, CPU, seed=3, progress=False)
    fast = train_fast(conv_net(), *dataloaders, 2, 0.1, CPU, seed=3, progress=False,
                      techniques=Techniques())
    assert fast.train_loss == plain.train_loss and fast.test_acc == plain.test_acc
    assert fast.train_acc == plain.train_acc


def test_train_fast_defaults_to_the_fast_techniques():
    def loaders():
        images, labels = indexed_data(96, size=8)
        labels = labels % 10
        return (DeviceLoader(images, labels, 32, device=CPU, shuffle=True),
                DeviceLoader(images, labels, 32, device=CPU))

    def net():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    named = train_fast(net(), *loaders(), 2, 0.1, CPU, seed=3, progress=False,
                       techniques=d2lgpu.Techniques.fast(CPU))
    default = train_fast(net(), *loaders(), 2, 0.1, CPU, seed=3, progress=False)
    assert named.train_loss == default.train_loss
    assert named.test_acc == default.test_acc


# --------------------------------------------------------------------------- #
# The technique switches: each changes what it claims
# --------------------------------------------------------------------------- #

Techniques = d2lgpu.Techniques


def tiny_data(n: int = 64, batch: int = 16):
    """uint8 8x8 images with 4 classes: a DeviceLoader pair and a DataLoader pair."""
    from torch.utils import data

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=generator)
    labels = torch.arange(n) % 4
    resident = (DeviceLoader(images, labels, batch, device=CPU, shuffle=True),
                DeviceLoader(images, labels, batch, device=CPU))
    dataset = data.TensorDataset(images.float() / 255, labels)
    return resident, (data.DataLoader(dataset, batch), data.DataLoader(dataset, batch))


def conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(64, 4))


def run(techniques, loaders, net=None, **kwargs):
    net = conv_net() if net is None else net
    kwargs = dict(seed=0, progress=False) | kwargs
    return train_fast(net, *loaders, 1, 0.1, CPU, techniques=techniques, **kwargs)


def test_techniques_are_switches_with_named_presets():
    assert str(Techniques()) == "no_sync"  # chapter 4's loop, d2lgpu.train
    assert str(Techniques.d2l_style()) == "none (d2l-style)"
    fast = Techniques(device_data=True, compile=True)
    assert str(fast) == "device_data + no_sync + compile"
    assert str(dataclasses.replace(fast, compile=False)) == "device_data + no_sync"
    with pytest.raises(TypeError, match="Techniques.channels_last must be True or False"):
        Techniques(channels_last="yes")
    with pytest.raises(ValueError, match=r"Techniques.precision='half' is not one of 'auto', "):
        Techniques(precision="half")
    assert str(Techniques(precision="bf16")) == "no_sync + precision bf16"
    assert str(Techniques(device_data=True, precision="auto")) == (
        "device_data + no_sync + precision auto")


def test_fast_techniques_follow_the_skip_reasons_of_the_device():
    fast = Techniques.fast(CPU)
    assert fast.device_data and fast.no_sync
    assert not (fast.channels_last or fast.compile or fast.cuda_graphs)
    # Fused SGD joins the fast path wherever this torch has a fused kernel for the device
    # type (the CPU in torch 2.15); elsewhere the skip reason says so.
    fused_here = "cpu" in d2lgpu.fast.fused_sgd_device_types()
    assert fast.fused_optimizer == fused_here
    reason = d2lgpu.technique_skip_reason("fused_optimizer", CPU)
    assert (reason is None) == fused_here and (fused_here or "fused SGD" in reason)
    for name in d2lgpu.fast.TECHNIQUES:
        reason = d2lgpu.technique_skip_reason(name, CPU)
        assert reason is None or len(reason) <= 64, (name, reason)
    assert "CPU" in d2lgpu.technique_skip_reason("cuda_graphs", CPU)
    assert d2lgpu.technique_skip_reason("device_data", CPU) is None
    if shutil.which("c++") or shutil.which("g++"):
        assert d2lgpu.technique_skip_reason("compile", CPU) is None
    with pytest.raises(ValueError, match="unknown technique"):
        d2lgpu.technique_skip_reason("turbo", CPU)


def test_device_data_switch_reads_device_loaders_and_refuses_the_wrong_kind(monkeypatch):
    resident, dataloaders = tiny_data()
    calls = []
    original = DeviceLoader.__iter__

    def counting_iter(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(DeviceLoader, "__iter__", counting_iter)
    run(Techniques(device_data=True), resident)
    assert calls == [resident[0], resident[1]]  # one training epoch, one evaluation
    with pytest.raises(TypeError, match="a DataLoader, but the device_data switch is on"):
        run(Techniques(device_data=True), dataloaders)


def test_no_sync_switch_removes_the_item_calls_of_every_step():
    # Counted by the profiler: aten::item is what .item() runs.
    from d2lgpu import profiling

    resident, _ = tiny_data()
    counts = {}
    for no_sync in (False, True):
        with torch.profiler.profile(activities=profiling.profiler_activities(CPU)) as prof:
            run(Techniques(device_data=True, no_sync=no_sync), resident)
        counts[no_sync] = {e.key: e.count for e in prof.key_averages()}
    steps = len(resident[0])
    assert counts[False]["train_step"] == counts[True]["train_step"] == steps
    # d2l-style: the loss and the correct count after every step; both: the two epoch sums
    # once, and once in the run the first step's loss (the divergence rule's start).
    # Evaluation reads its correct count once in both.
    assert counts[False]["aten::item"] == 2 * steps + 2 + 1 + 1
    assert counts[True]["aten::item"] == 2 + 1 + 1


def test_auto_precision_runs_the_forward_pass_in_the_auto_format(monkeypatch):
    import d2lgpu.precision as precision

    resident, _ = tiny_data()
    seen = []
    net = conv_net()
    net[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    auto = Techniques(device_data=True, precision="auto")
    run(auto, resident, net=net)
    assert set(seen) == {torch.bfloat16}
    seen.clear()
    run(dataclasses.replace(auto, precision="fp32"), resident, net=net)
    assert set(seen) == {torch.float32}
    seen.clear()
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    run(auto, resident, net=net)
    assert set(seen) == {torch.float32}  # 'auto' is fp32 where bf16 is emulated


def test_channels_last_switch_changes_the_layout():
    resident, _ = tiny_data()
    for switch in (False, True):
        net = conv_net()
        run(Techniques(device_data=True, channels_last=switch), resident, net=net)
        conv = net[2]  # four input channels: the two layouts differ
        assert conv.weight.is_contiguous(memory_format=torch.channels_last) is switch


def test_fused_optimizer_switch_picks_fused_sgd():
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    resident, _ = tiny_data()
    fused = []
    handle = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: fused.append(bool(optimizer.defaults.get("fused")))
    )
    try:
        run(Techniques(device_data=True), resident)
        run(Techniques(device_data=True, fused_optimizer=True), resident)
    finally:
        handle.remove()
    steps = len(resident[0])
    assert fused == [False] * steps + [True] * steps


def test_compile_switches_wrap_the_model():
    net = conv_net()
    assert d2lgpu.fast.compile_model(net, Techniques(), CPU) is net
    compiled = d2lgpu.fast.compile_model(net, Techniques(compile=True), CPU)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled._orig_mod is net  # shares the weights: nothing compiled until called
    with pytest.raises(ValueError, match="cuda_graphs=True cannot run on cpu"):
        d2lgpu.fast.compile_model(net, Techniques(cuda_graphs=True), CPU)


def test_train_argument_checks_for_techniques():
    resident, _ = tiny_data()
    with pytest.raises(TypeError, match="Techniques"):
        train_fast(conv_net(), *resident, 1, 0.1, CPU, techniques={"compile": True})


@pytest.mark.gpu
def test_gpu_fast_path_with_cuda_graphs_learns():
    device = torch.device("cuda", 0)
    train_loader, test_loader = fashion_mnist_on_device(64, device, quick=True)
    techniques = Techniques.fast(device, compile=True, cuda_graphs=True)
    assert str(techniques) == " + ".join(d2lgpu.fast.TECHNIQUES).replace(
        "precision", f"precision {techniques.precision}")
    history = train_fast(d2lgpu.small_cnn(), train_loader, test_loader, 3, 0.1, device,
                         seed=0, techniques=techniques, progress=False)
    assert history.test_acc[-1] > 0.4
    graphs_only = Techniques.fast(device, cuda_graphs=True)
    history = train_fast(d2lgpu.small_cnn(), train_loader, test_loader, 3, 0.1, device,
                         seed=0, techniques=graphs_only, progress=False)
    assert history.test_acc[-1] > 0.4


def test_device_loader_refuses_string_booleans():
    images = torch.zeros(4, 1, 2, 2, dtype=torch.uint8)
    labels = torch.zeros(4, dtype=torch.long)
    for name, value in (("shuffle", "no"), ("channels_last", 1)):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            DeviceLoader(images, labels, 2, device=CPU, **{name: value})


def test_compile_skip_reason_on_gpus_too_old_for_triton_and_without_triton(monkeypatch):
    # No GPU needed: the capability and Triton's presence are faked.
    import torch.utils._triton as triton_utils

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: True)
    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    reason = d2lgpu.technique_skip_reason("compile", gpu)
    assert "too old for Triton" in reason and "sm61" in reason and "pip" not in reason
    assert len(reason) <= 64
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "pip install triton" in d2lgpu.technique_skip_reason("compile", gpu)
    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    assert d2lgpu.technique_skip_reason("compile", gpu) is None


def test_benchmark_headers_and_skip_compile_rows(monkeypatch):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def load(name):
        spec = importlib.util.spec_from_file_location(name, root / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    train_speed = load("train_speed")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert train_speed.peak_header(torch.device("cuda", 0)) == "% fp16 peak"  # a T4
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert train_speed.peak_header(torch.device("cuda", 0)) == "% bf16 peak"  # an H100
    assert train_speed.peak_header(torch.device("cuda", 0), 100.0) == "% given peak"

    from d2lgpu import profiling

    skip = load("ablation").skip_compiled_rows()
    assert set(skip) == {"compile", "cuda_graphs"}
    plan = profiling.ablation_plan(CPU, skip=skip)
    assert not any(step.techniques.compile or step.techniques.cuda_graphs for step in plan)


@pytest.mark.parametrize("kwargs, name", [
    (dict(params=None), "params"),
    (dict(params=[1.0]), "params"),
    (dict(lr=None), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(lr=True), "lr"),
    (dict(device=-1), "device"),
])
def test_make_sgd_refuses_bad_arguments_by_name(kwargs, name):
    args = dict(params=list(nn.Linear(2, 2).parameters()), lr=0.1, device="cpu")
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError)) as info:
        make_sgd(**args)
    assert name in str(info.value), str(info.value)


def test_compile_model_names_a_bad_device():
    with pytest.raises(ValueError, match="device"):
        d2lgpu.fast.compile_model(nn.Linear(2, 2), d2lgpu.fast.Techniques(), -1)


def test_smoke_mode_leaves_compile_out_on_a_cpu_and_says_why(monkeypatch):
    monkeypatch.delenv("D2LGPU_QUICK", raising=False)
    monkeypatch.setenv("D2LGPU_SMOKE", "1")
    monkeypatch.setattr(d2lgpu.fast, "_has_cxx_compiler", lambda: True)
    reason = d2lgpu.technique_skip_reason("compile", "cpu")
    assert reason is not None and "smoke mode" in reason and len(reason) <= 64
    monkeypatch.delenv("D2LGPU_SMOKE")
    assert d2lgpu.technique_skip_reason("compile", "cpu") is None  # CPU mode compiles


def test_a_device_loader_reused_under_a_seed_shuffles_as_it_did_the_first_time():
    resident, _ = tiny_data()
    first = run(Techniques(device_data=True), resident)
    again = run(Techniques(device_data=True), resident)  # the loader's generator moved on
    assert again.train_loss == first.train_loss
