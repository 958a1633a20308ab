"""Tests of d2lgpu.training: seeding, initialisation, devices, evaluation and the train loop."""

import math
import threading
import warnings

import matplotlib.pyplot as plt
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import d2lgpu
from d2lgpu.fast import Techniques
from d2lgpu.models import small_cnn
from d2lgpu.training import (
    History,
    SGDRecipe,
    _AutocastForward,
    evaluate_accuracy,
    init_weights,
    set_seed,
    train,
    warmup_scheduler,
)


@pytest.fixture(scope="module")
def quick_loaders():
    """The quick Fashion-MNIST subset as in-memory loaders (no file reads per test)."""
    if not (d2lgpu.data_root() / "FashionMNIST" / "raw").is_dir():
        pytest.skip("Fashion-MNIST raw files are not under D2LGPU_DATA")
    train_x, train_y = d2lgpu.fashion_mnist_tensors(train=True, quick=True)
    test_x, test_y = d2lgpu.fashion_mnist_tensors(train=False, quick=True)
    train_set = TensorDataset(train_x.float() / 255, train_y)
    test_set = TensorDataset(test_x.float() / 255, test_y)
    return DataLoader(train_set, batch_size=50, shuffle=True), DataLoader(test_set, batch_size=100)


def tiny_loaders(n: int = 40):
    """Random images in a tiny loader, for tests that only need the loop to run."""
    gen = torch.Generator().manual_seed(0)
    X = torch.rand(n, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return DataLoader(TensorDataset(X, y), batch_size=10, shuffle=True), DataLoader(
        TensorDataset(X, y), batch_size=20
    )


def test_set_seed_repeats_torch_draws_and_rejects_bad_seeds():
    set_seed(5)
    first = torch.rand(4)
    set_seed(5)
    assert torch.equal(torch.rand(4), first)
    for bad in (-1, 1.5, True, "1", 2**64):
        with pytest.raises(ValueError, match="seed"):
            set_seed(bad)
    set_seed(2**64 - 1)  # the largest seed torch takes


def test_init_weights_resets_everything_and_is_seeded():
    net = small_cnn()
    bn = net[1]
    with torch.no_grad():
        bn.weight.fill_(3.0)
        bn.running_mean.fill_(5.0)
        net[0].bias.fill_(2.0)
    set_seed(0)
    init_weights(net)
    assert torch.equal(bn.weight, torch.ones_like(bn.weight))
    assert torch.equal(bn.running_mean, torch.zeros_like(bn.running_mean))
    assert torch.equal(net[0].bias, torch.zeros_like(net[0].bias))
    # Xavier-uniform bound for a 5x5 conv from 1 to 6 channels: sqrt(6 / (fan_in + fan_out)).
    bound = math.sqrt(6 / (1 * 25 + 6 * 25))
    assert net[0].weight.abs().max() <= bound
    state = {k: v.clone() for k, v in net.state_dict().items()}
    set_seed(0)
    init_weights(net)
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())


class ConstantClassifier(nn.Module):
    """Always predicts class 0; has one parameter so that it has a device."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, X):
        logits = torch.zeros(X.shape[0], 10)
        logits[:, 0] = self.scale
        return logits


def test_evaluate_accuracy_counts_and_restores_the_mode():
    y = torch.tensor([0, 0, 0, 1, 2, 3, 0, 4])  # 4 of 8 are class 0
    loader = DataLoader(TensorDataset(torch.zeros(8, 3), y), batch_size=3)
    net = ConstantClassifier()
    net.train()
    assert evaluate_accuracy(net, loader) == 0.5
    assert net.training
    net.eval()
    assert evaluate_accuracy(net, loader, "cpu") == 0.5
    assert not net.training
    with pytest.raises(ValueError, match="no examples"):
        evaluate_accuracy(net, [])


def test_warmup_ramps_linearly_then_holds():
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = warmup_scheduler(optimizer, warmup_epochs=1, steps_per_epoch=4)
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_scheduler(optimizer, 0, 4) is None


def test_warmup_goes_on_quietly_when_a_grad_scaler_skips_the_optimizer_step():
    # fp16 training skips optimizer steps whose gradients overflowed; the ramp counts
    # batches regardless, and must not warn about stepping before the optimizer.
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler = warmup_scheduler(optimizer, warmup_epochs=1, steps_per_epoch=2)
        scheduler.step()  # no optimizer.step() before it
    assert optimizer.param_groups[0]["lr"] == 1.0


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(num_epochs=0, lr=0.1), "num_epochs"), (dict(num_epochs=1.5, lr=0.1), "num_epochs"),
     (dict(num_epochs=1, lr=0.0), "lr"), (dict(num_epochs=1, lr=-0.1), "lr"),
     (dict(num_epochs=2, lr=SGDRecipe(0.1, warmup_epochs=3)), "warmup_epochs"),
     (dict(num_epochs=1, lr=0.1, devices=["cpu", "cpu"]), "one CPU device")],
)
def test_train_rejects_bad_input(kwargs, match):
    train_iter, test_iter = tiny_loaders()
    with pytest.raises(ValueError, match=match):
        train(small_cnn(), train_iter, test_iter, progress=False, plot=False, **kwargs)


@pytest.mark.parametrize(
    "recipe, match",
    [(dict(lr=math.inf), "lr must be a positive finite number, got inf"),
     (dict(lr=math.nan), "lr must be a positive finite number, got nan"),
     (dict(lr=0.1, weight_decay=math.nan), "weight_decay must be a finite number >= 0"),
     (dict(lr=0.1, weight_decay=math.inf), "weight_decay"),
     (dict(lr=0.1, momentum=math.nan), "momentum"),
     (dict(lr=0.1, momentum=1.0), "momentum"),
     (dict(lr=0.1, warmup_epochs=math.nan), "warmup_epochs")],
)
def test_a_recipe_refuses_hyperparameters_that_cannot_be_meant(recipe, match):
    with pytest.raises(ValueError, match=match):
        SGDRecipe(**recipe)


@pytest.mark.parametrize("fast", [False, True])
def test_train_and_train_fast_refuse_a_bad_lr_before_any_work(fast):
    train_iter, test_iter = tiny_loaders()
    if fast:
        train_iter = test_iter = (torch.zeros(4, 1, 28, 28, dtype=torch.uint8), torch.zeros(4))
    run = d2lgpu.train_fast if fast else train
    with pytest.raises(ValueError, match="lr must be a positive finite number, got inf"):
        run(small_cnn(), train_iter, test_iter, 1, math.inf, "cpu", progress=False)


def test_a_recipe_trains_as_its_plain_torch_optimizer():
    # SGDRecipe(lr, momentum, weight_decay) is torch.optim.SGD with those settings: the
    # same run by hand (seed, init, the same batches) ends with the same weights.
    train_iter, test_iter = tiny_loaders()
    recipe = SGDRecipe(0.05, momentum=0.9, weight_decay=1e-3)
    net = linear_net()
    train(net, train_iter, test_iter, 1, recipe, "cpu", seed=0, progress=False, plot=False)
    by_hand = linear_net()
    set_seed(0)
    init_weights(by_hand)
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for X, y in train_iter:
        optimizer.zero_grad()
        nn.functional.cross_entropy(by_hand(X), y).backward()
        optimizer.step()
    for ours, theirs in zip(net.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("word, fix", [("half", "fp16"), ("bfloat16", "bf16"), ("off", "fp32")])
def test_train_refuses_other_precision_words_naming_the_word_to_write(word, fix):
    train_iter, test_iter = tiny_loaders()
    with pytest.raises(ValueError, match=rf"precision={word!r} is not one of .*"
                                         rf"write precision={fix!r}"):
        train(linear_net(), train_iter, test_iter, 1, 0.1, "cpu", precision=word, progress=False)


@pytest.mark.parametrize("fast", [False, True])
def test_diverging_training_stops_with_the_epoch_and_the_fix(fast):
    techniques = Techniques(device_data=True) if fast else None
    # lr=1e6 blows the small CNN's weights up: its loss is NaN by the end of epoch 1.
    gen = torch.Generator().manual_seed(0)
    X = torch.randint(0, 256, (40, 1, 28, 28), generator=gen, dtype=torch.uint8)
    y = torch.randint(0, 10, (40,), generator=gen)
    if fast:  # the fast path keeps sums on the device: the check needs no extra sync
        train_iter = d2lgpu.DeviceLoader(X, y, 10, device="cpu", shuffle=True)
        test_iter = d2lgpu.DeviceLoader(X, y, 20, device="cpu")
    else:
        data = TensorDataset(X.float() / 255, y)
        train_iter, test_iter = DataLoader(data, batch_size=10), DataLoader(data, batch_size=20)
    with pytest.raises(FloatingPointError, match=r"loss became nan in epoch 1") as info:
        train(small_cnn(), train_iter, test_iter, num_epochs=3, lr=1e6, devices="cpu", seed=0,
              progress=False, plot=False, techniques=techniques, precision="fp32")
    assert "smaller lr (this run: 1e+06)" in str(info.value)


def test_a_loss_that_grows_but_stays_finite_is_divergence_named_with_its_steps():
    # lr=1e6 on a linear classifier: the epoch losses are huge but finite (about 1e7),
    # millions of times the first step's. The first epoch is measured against the first
    # step, not against its own mean, so the run stops in epoch 1.
    train_iter, test_iter = tiny_loaders()
    with pytest.raises(FloatingPointError,
                       match=r"grew to .*, more than 10 times the .* it started from, in "
                             r"epoch 1 \(steps 1-4\): training diverged at lr 1e\+06"):
        train(linear_net(), train_iter, test_iter, num_epochs=2, lr=1e6, devices="cpu",
              seed=0, progress=False, plot=False)
    history = train(linear_net(), train_iter, test_iter, num_epochs=2, lr=0.01, devices="cpu",
                    seed=0, progress=False, plot=False)
    assert len(history.train_loss) == 2  # a sane lr on the same data is not stopped


def test_train_beats_chance_and_returns_a_well_formed_history(quick_loaders):
    train_iter, test_iter = quick_loaders
    epochs = 4
    history = train(small_cnn(), train_iter, test_iter, epochs, lr=0.1, devices="cpu",
                    seed=0, progress=False, plot=False)
    for name in ("train_loss", "train_acc", "test_acc", "epoch_seconds", "examples_per_second"):
        values = getattr(history, name)
        assert len(values) == epochs and all(math.isfinite(v) for v in values), name
    assert all(0 <= a <= 1 for a in history.train_acc + history.test_acc)
    assert all(s > 0 for s in history.epoch_seconds + history.examples_per_second)
    assert history.device == "cpu" and history.num_epochs == epochs
    assert history.train_loss[-1] < history.train_loss[0]
    assert history.test_acc[-1] > 0.5  # chance is 0.1 on ten balanced classes
    assert "test acc" in history.summary()
    assert history.to_dict()["test_acc"] == history.test_acc


def test_same_seed_same_history_even_when_the_model_object_is_reused(quick_loaders):
    train_iter, test_iter = quick_loaders
    net = small_cnn()
    options = dict(num_epochs=1, lr=0.1, devices="cpu", seed=1, progress=False, plot=False)
    first = train(net, train_iter, test_iter, **options)
    # The same object again: every parameter and BN statistic is reset under the seed,
    # so the second run does not continue from the first (d2l's 13.6 pitfall).
    second = train(net, train_iter, test_iter, **options)
    assert second.train_loss == first.train_loss
    assert second.test_acc == first.test_acc
    other = train(small_cnn(), train_iter, test_iter, **{**options, "seed": 2})
    assert other.train_loss != first.train_loss


def test_init_false_continues_from_the_current_weights():
    train_iter, test_iter = tiny_loaders()
    net = small_cnn()
    options = dict(lr=0.1, devices="cpu", seed=0, progress=False, plot=False)
    first = train(net, train_iter, test_iter, num_epochs=3, **options)
    resumed = train(net, train_iter, test_iter, num_epochs=1, init=False, **options)
    fresh = train(small_cnn(), train_iter, test_iter, num_epochs=1, **options)
    assert fresh.train_loss == first.train_loss[:1]
    assert resumed.train_loss[0] < first.train_loss[0]


def test_bf16_on_cpu_trains_in_bf16_without_cuda_warnings():
    train_iter, test_iter = tiny_loaders()
    net = small_cnn()
    seen = set()
    net[0].register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train(net, train_iter, test_iter, 1, lr=0.1, devices="cpu",
                        seed=0, precision="bf16", progress=False, plot=False)
    assert math.isfinite(history.train_loss[0])
    assert seen == {torch.bfloat16}
    assert not [w for w in caught if "cuda" in str(w.message).lower()]


@pytest.mark.parametrize("precision, techniques, dtype", [
    (None, None, torch.float32),  # the plain loop: fp32
    ("bf16", None, torch.bfloat16),
    (None, Techniques(precision="bf16"), torch.bfloat16),  # the techniques' word
    ("fp32", Techniques(precision="bf16"), torch.float32),  # precision= wins
])
def test_precision_or_the_techniques_word_sets_the_autocast_dtype(precision, techniques, dtype):
    train_iter, test_iter = tiny_loaders()
    net = linear_net()  # autocast lowers its matmul to bf16 on the CPU too
    seen = set()
    net[1].register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    train(net, train_iter, test_iter, 1, 0.1, "cpu", precision=precision,
          techniques=techniques, progress=False, plot=False)
    assert seen == {dtype}


def test_train_runs_under_the_policys_matmul_precision(monkeypatch):
    # TF32 exists on CUDA only; on the CPU the policy's context is entered and changes nothing.
    entered = []
    real = d2lgpu.precision.PrecisionPolicy.matmul_precision

    def spy(self):
        entered.append(self.name)
        return real(self)

    monkeypatch.setattr(d2lgpu.precision.PrecisionPolicy, "matmul_precision", spy)
    train_iter, test_iter = tiny_loaders()
    before = torch.get_float32_matmul_precision()
    train(linear_net(), train_iter, test_iter, 1, 0.1, "cpu", precision="tf32", progress=False,
          plot=False)
    assert entered == ["tf32"]
    assert torch.get_float32_matmul_precision() == before


def test_plot_none_outside_a_notebook_draws_nothing_and_plot_true_cleans_up():
    train_iter, test_iter = tiny_loaders()
    before = set(plt.get_fignums())
    train(small_cnn(), train_iter, test_iter, 1, lr=0.1, devices="cpu", progress=False)
    train(small_cnn(), train_iter, test_iter, 1, lr=0.1, devices="cpu", progress=False,
          plot=True)
    assert set(plt.get_fignums()) == before


def test_autocast_forward_applies_the_policy_in_another_thread():
    # DataParallel runs replicas in worker threads, where the caller's autocast dtype
    # is not inherited; the wrapper must bring the policy's dtype with it.
    policy = d2lgpu.precision_policy("cpu", "bf16")
    wrapped = _AutocastForward(nn.Linear(4, 2), policy)
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=wrapped(torch.ones(3, 4))))
    worker.start()
    worker.join()
    assert result["out"].dtype == torch.bfloat16
    assert nn.Linear(4, 2)(torch.ones(3, 4)).dtype == torch.float32  # nothing leaks out


def test_history_summary_and_dict():
    history = History([0.5], [0.8], [0.75], [2.0], [100.0], device="cpu")
    assert history.summary() == (
        "loss 0.500, train acc 0.800, test acc 0.750; 100.0 examples/sec on cpu"
    )
    assert history.to_dict() == dict(
        train_loss=[0.5], train_acc=[0.8], test_acc=[0.75], epoch_seconds=[2.0],
        examples_per_second=[100.0], device="cpu",
    )
    assert "no epochs" in History(device="cpu").summary()


@pytest.mark.gpu
def test_train_on_one_gpu_with_auto_precision(quick_loaders):
    train_iter, test_iter = quick_loaders
    net = small_cnn()
    history = train(net, train_iter, test_iter, 3, lr=0.1, devices=[d2lgpu.gpu(0)], seed=0,
                    precision="auto", progress=False, plot=False)
    assert next(net.parameters()).device == torch.device("cuda", 0)
    assert history.device == "cuda:0"
    assert history.test_acc[-1] > 0.5


@pytest.mark.multigpu
def test_train_with_data_parallel_on_two_gpus(quick_loaders):
    train_iter, test_iter = quick_loaders
    net = small_cnn()
    history = train(net, train_iter, test_iter, 3, lr=0.1, devices=[d2lgpu.gpu(0), d2lgpu.gpu(1)],
                    seed=0, progress=False, plot=False)
    assert history.device == "cuda:0, cuda:1"
    assert not isinstance(net, nn.DataParallel)  # trained in place, returned unwrapped
    assert next(net.parameters()).device == torch.device("cuda", 0)
    assert history.test_acc[-1] > 0.5


@pytest.mark.multigpu
def test_data_parallel_replicas_run_in_the_policy_dtype(quick_loaders):
    train_iter, test_iter = quick_loaders
    net = small_cnn()
    seen = set()
    net[0].register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    train(net, train_iter, test_iter, 1, lr=0.1, devices=[d2lgpu.gpu(0), d2lgpu.gpu(1)],
          precision="bf16", progress=False, plot=False)
    assert seen == {torch.bfloat16}


# --------------------------------------------------------------------------- #
# Bad input is named before any work; the cause of a NaN loss is named right
# --------------------------------------------------------------------------- #


def linear_net():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [(dict(train_iter=None), TypeError, r"train_iter must yield batches \(X, y\), got None"),
     (dict(test_iter="data"), TypeError, r"test_iter must yield batches"),
     (dict(train_iter=[]), ValueError, r"train_iter is empty"),
     (dict(lr=None), ValueError, r"lr must be a positive finite number, got None"),
     (dict(lr="0.1"), ValueError, r"lr must be a positive finite number, got '0.1'"),
     (dict(precision=True), ValueError, r"precision=True is not one of .*precision='auto'"),
     (dict(techniques="fast"), TypeError, r"techniques must be a d2lgpu.Techniques"),
     (dict(progress="false"), TypeError, r"progress must be True or False"),
     (dict(init=1), TypeError, r"init must be True or False"),
     (dict(net=None), TypeError, r"net must be a torch.nn.Module")],
)
def test_train_names_the_bad_argument_before_any_work(kwargs, error, match):
    train_iter, test_iter = tiny_loaders()
    args = dict(net=linear_net(), train_iter=train_iter, test_iter=test_iter, num_epochs=1,
                lr=0.1, devices="cpu", progress=False, plot=False)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        train(**args)


def test_a_loader_of_the_wrong_items_is_named_with_the_batch_number():
    _, test_iter = tiny_loaders()
    X = torch.rand(10, 1, 28, 28)
    with pytest.raises(TypeError, match=r"batch 0 of train_iter is Tensor"):
        train(linear_net(), [X], test_iter, 1, 0.1, "cpu", progress=False, plot=False)
    with pytest.raises(TypeError, match=r"batch 0 of data_iter holds \(Tensor, list\)"):
        evaluate_accuracy(linear_net(), [(X, [0] * 10)])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_inf_in_the_data_is_blamed_on_the_data_not_the_lr(bad):
    gen = torch.Generator().manual_seed(0)
    X = torch.rand(40, 1, 28, 28, generator=gen)
    X[17, 0, 3, 3] = bad  # in the second batch
    y = torch.randint(0, 10, (40,), generator=gen)
    data = DataLoader(TensorDataset(X, y), batch_size=10)
    with pytest.raises(ValueError, match=r"batch 1 of train_iter holds") as info:
        train(linear_net(), data, data, 1, 0.1, "cpu", progress=False, plot=False)
    assert "lr" not in str(info.value) and "the data are broken" in str(info.value)
    assert isinstance(info.value.__cause__, FloatingPointError)


def test_nan_weights_kept_by_init_false_are_named_before_training():
    net = linear_net()
    with torch.no_grad():
        net[1].weight[0, 0] = math.nan
    train_iter, test_iter = tiny_loaders()
    with pytest.raises(ValueError, match=r"the model's weights \(init=False keeps them\) hold "
                                         r"1 NaN value.*init=True"):
        train(net, train_iter, test_iter, 1, 0.1, "cpu", progress=False, plot=False, init=False)


def test_init_weights_and_evaluate_name_a_missing_model():
    with pytest.raises(TypeError, match=r"net must be a torch.nn.Module.*got NoneType"):
        init_weights(None)
    with pytest.raises(TypeError, match=r"data_iter must yield batches"):
        evaluate_accuracy(linear_net(), None)


def test_train_fast_checks_its_switches():
    pair = (torch.zeros(4, 1, 28, 28, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64))
    for name in ("progress", "init"):
        with pytest.raises(TypeError, match=rf"{name} must be True or False"):
            d2lgpu.train_fast(linear_net(), pair, pair, 1, 0.1, "cpu", **{name: "no"})
    for techniques in (Techniques(), "fast"):  # the data stay on the device here
        with pytest.raises(ValueError, match=r"techniques must be a d2lgpu.Techniques with "
                                             r"device_data=True"):
            d2lgpu.train_fast(linear_net(), pair, pair, 1, 0.1, "cpu", techniques=techniques)


@pytest.mark.parametrize("kwargs, name", [
    (dict(scheduler="no"), "scheduler"),
    (dict(scheduler=1), "scheduler"),
    (dict(on_batch=True), "on_batch"),
    (dict(techniques=None), "techniques"),
    (dict(techniques="no"), "techniques"),
])
def test_train_epoch_names_a_bad_hook_or_techniques(kwargs, name):
    from d2lgpu.training import train_epoch

    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    X = torch.rand(8, 4, generator=torch.Generator().manual_seed(0))
    policy = d2lgpu.precision_policy("cpu", "fp32")
    args = dict(net=net, train_iter=DataLoader(TensorDataset(X, torch.arange(8) % 3),
                                               batch_size=4),
                loss_fn=nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                device=torch.device("cpu"), policy=policy, scaler=policy.make_scaler())
    args.update(kwargs)
    with pytest.raises(TypeError, match=name):
        train_epoch(**args)
