"""Tests of d2lgpu.precision: the policy, the TF32 switch, GradScaler behaviour and the sweep."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

from d2lgpu import precision as P

# ---------------------------------------------------------------------------
# Which formats and which policy per compute capability
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capability", "dtype", "use_scaler"),
    [
        ((6, 1), None, False),  # no Tensor Cores: autocast would only slow it down
        ((7, 0), torch.float16, True),
        ((7, 5), torch.float16, True),  # T4: bf16 would be emulated
        ((8, 0), torch.bfloat16, False),
        ((9, 0), torch.bfloat16, False),
    ],
)
def test_auto_policy_follows_compute_capability(capability, dtype, use_scaler):
    policy = P.precision_policy("cuda:0", "auto", capability=capability)
    assert (policy.device_type, policy.dtype, policy.use_scaler) == ("cuda", dtype, use_scaler)


def test_auto_policy_on_cpu_is_bf16_without_scaler_where_native(monkeypatch):
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: True)
    policy = P.precision_policy("cpu")
    assert (policy.device_type, policy.dtype, policy.use_scaler) == ("cpu", torch.bfloat16, False)
    assert policy.name == "bf16"


def test_auto_policy_on_cpu_without_native_bf16_is_fp32(monkeypatch):
    # Emulated bf16 is slower than fp32: "auto" means what the device runs fast.
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: False)
    assert P.precision_policy("cpu", "auto").dtype is None
    assert P.precision_policy("cpu", "bf16").dtype == torch.bfloat16  # forcing still works
    # The sweep still sets bf16 against fp32 on such a CPU, to show what it costs.
    assert P.amp_sweep_mode("cpu") == "bf16"


@pytest.mark.parametrize("capability", [(6, 1), (7, 5), (9, 0)])
@pytest.mark.parametrize(
    ("precision", "dtype", "use_scaler", "tf32", "name"),
    [
        ("fp16", torch.float16, True, None, "fp16 + GradScaler"),
        ("bf16", torch.bfloat16, False, None, "bf16"),
        ("fp32", None, False, False, "fp32"),
        ("tf32", None, False, True, "tf32"),
    ],
)
def test_explicit_policy_ignores_capability(capability, precision, dtype, use_scaler, tf32, name):
    policy = P.precision_policy("cuda", precision, capability=capability)
    assert (policy.dtype, policy.use_scaler, policy.tf32, policy.name) == (
        dtype, use_scaler, tf32, name)


def test_the_vocabulary_is_the_five_words_every_entry_point_takes():
    assert P.PRECISIONS == ("auto", "fp32", "tf32", "fp16", "bf16")
    for word in P.PRECISIONS:
        assert P.check_precision(word) == word


@pytest.mark.parametrize("precision", [True, False, None, "half", "BF16", "bfloat16", "off",
                                       "fp8", "yes", 1, 0.5, torch.float16, torch.float64])
def test_other_spellings_are_refused_with_the_five_words(precision):
    # not even the close ones: one vocabulary, spelt one way, in every entry point
    with pytest.raises(ValueError, match=r"precision=.* is not one of 'auto', 'fp32', 'tf32', "
                                         r"'fp16', 'bf16'$"):
        P.precision_policy("cpu", precision)


def test_tf32_switch_acts_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(
        P, "tf32_matmuls", lambda enabled: calls.append(enabled) or contextlib.nullcontext()
    )
    with P.PrecisionPolicy("cpu", None, False, tf32=True).matmul_precision():
        pass
    with P.PrecisionPolicy("cuda", None, False, tf32=None).matmul_precision():
        pass
    assert calls == []
    with P.PrecisionPolicy("cuda", None, False, tf32=False).matmul_precision():
        pass
    with P.PrecisionPolicy("cuda", None, False, tf32=True).matmul_precision():
        pass
    assert calls == [False, True]


@pytest.mark.parametrize(
    "device, error", [("nonsense", ValueError), ("gpu0", ValueError), (3.5, TypeError)]
)
def test_a_device_torch_does_not_know_is_a_clear_error(device, error):
    with pytest.raises(error, match="is not a device") as info:
        P.precision_policy(device)
    assert "'cpu'" in str(info.value) and "'cuda'" in str(info.value)


def test_cuda_policy_without_a_gpu_says_how_to_fall_back(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="try_gpu"):
        P.precision_policy("cuda:0", "auto")


def test_fp32_policy_autocast_changes_nothing():
    layer = nn.Linear(4, 3)
    with P.precision_policy("cpu", "fp32").autocast():
        assert layer(torch.randn(2, 4)).dtype == torch.float32
    # nothing at all, on any device type: torch.autocast refuses "meta", even switched off
    with P.PrecisionPolicy("meta", None, False).autocast():
        assert not torch.is_autocast_enabled()


def test_cpu_bf16_autocast_lowers_matmuls_and_keeps_losses_in_fp32():
    layer = nn.Linear(8, 4)
    x = torch.randn(5, 8)
    with P.precision_policy("cpu", "bf16").autocast():
        logits = layer(x)
        loss = nn.functional.cross_entropy(logits, torch.zeros(5, dtype=torch.long))
        assert logits.dtype == torch.bfloat16
        assert (x @ x.T).dtype == torch.bfloat16
        assert loss.dtype == torch.float32
    assert layer(x).dtype == torch.float32  # outside the context fp32 again


def test_make_scaler_is_enabled_only_for_fp16():
    # (A CUDA scaler on a machine without CUDA disables itself, so the fp16 case uses the CPU.)
    assert P.precision_policy("cpu", "fp16").make_scaler().is_enabled()
    assert not P.precision_policy("cpu", "bf16").make_scaler().is_enabled()
    assert not P.precision_policy("cpu", "fp32").make_scaler().is_enabled()


# ---------------------------------------------------------------------------
# The TF32 switch
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("restore_matmul_settings")
@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_matmuls_sets_both_flags_and_restores_them(enabled):
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = not enabled
    with P.tf32_matmuls(enabled):
        assert torch.backends.cuda.matmul.allow_tf32 is enabled
        assert torch.backends.cudnn.allow_tf32 is enabled
        assert torch.get_float32_matmul_precision() == ("high" if enabled else "highest")
    assert torch.get_float32_matmul_precision() == "medium"
    assert torch.backends.cudnn.allow_tf32 is (not enabled)


@pytest.mark.usefixtures("restore_matmul_settings")
def test_tf32_matmuls_restores_after_an_error():
    torch.set_float32_matmul_precision("highest")
    with pytest.raises(KeyError), P.tf32_matmuls(True):
        raise KeyError("inside")
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.usefixtures("restore_matmul_settings")
@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_matmuls_after_a_learner_set_the_new_api_alone(enabled):
    # Chapters 1 and 6 show `torch.backends.cuda.matmul.fp32_precision = "tf32"`. The legacy
    # flags then disagree, and torch raises "mix of the legacy and new APIs" at their next
    # read, on any device: the trainers, which enter tf32_matmuls, must still run.
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.backends.cuda.matmul.allow_tf32  # noqa: B018 - the read is what raises
    with P.tf32_matmuls(enabled):
        assert torch.backends.cuda.matmul.allow_tf32 is enabled
        assert torch.backends.cudnn.allow_tf32 is enabled
        assert torch.backends.cudnn.conv.fp32_precision == ("tf32" if enabled else "ieee")
    # The learner's choice is kept, and the legacy flags now agree with it.
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.usefixtures("restore_matmul_settings")
def test_set_tf32_leaves_both_apis_in_agreement():
    for matmul, conv in [("tf32", "tf32"), ("ieee", "ieee"), ("none", "tf32"), ("tf32", "ieee")]:
        P.set_tf32(matmul, conv)
        assert torch.backends.cuda.matmul.allow_tf32 is (matmul == "tf32")
        assert torch.backends.cudnn.allow_tf32 is (conv == "tf32")
        assert torch.backends.cudnn.conv.fp32_precision == conv
    P.set_tf32("none", "tf32")  # torch's defaults


# ---------------------------------------------------------------------------
# GradScaler: scaling, skipped steps, unscaling, checkpoints
# ---------------------------------------------------------------------------


def _tiny_regression():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    return model, x, y


def test_grad_scaler_skips_a_step_with_an_inf_gradient_and_backs_off():
    model, x, y = _tiny_regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = [p.detach().clone() for p in model.parameters()]

    loss = nn.functional.mse_loss(model(x), y)
    scaled = scaler.scale(loss)
    assert torch.equal(scaled, loss * 2.0**16)  # multiplying by a power of two is exact
    scaled.backward()
    model.weight.grad[0, 0] = float("inf")  # what an fp16 overflow leaves behind
    scaler.step(optimizer)
    scaler.update()

    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old, new)  # the step was skipped
    assert scaler.get_scale() == 2.0**16 * scaler.get_backoff_factor()


def test_grad_scaler_takes_a_finite_step_like_plain_sgd():
    model, x, y = _tiny_regression()
    reference, _, _ = _tiny_regression()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()

    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    plain.step()

    for scaled_p, plain_p in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(scaled_p, plain_p)
    assert scaler.get_scale() == 2.0**10  # no growth before growth_interval clean steps


def test_unscale_before_clipping_gives_the_true_gradients():
    model, x, y = _tiny_regression()
    reference, _, _ = _tiny_regression()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaled_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    scaler.unscale_(optimizer)
    true_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))

    nn.functional.mse_loss(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    torch.testing.assert_close(scaled_norm, true_norm * 2.0**16)


def test_grad_scaler_state_survives_a_checkpoint():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    model, x, y = _tiny_regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    model.bias.grad.fill_(float("nan"))
    scaler.step(optimizer)
    scaler.update()

    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(scaler.state_dict())
    assert restored.get_scale() == scaler.get_scale() == 2.0**15


# ---------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------


class _RunsOutOfMemoryAt(nn.Module):
    """A linear model that raises the CUDA OOM error for one batch size, like a full GPU."""

    def __init__(self, failing_batch_size: int) -> None:
        super().__init__()
        self.failing_batch_size = failing_batch_size
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.failing_batch_size:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return self.linear(x)


def test_sweep_records_oom_and_goes_on_to_the_next_size_and_mode():
    rows = P.precision_sweep(
        lambda: _RunsOutOfMemoryAt(16),
        P.random_batch_maker((6,), num_classes=3),
        ["fp32", "bf16"],
        [4, 16, 8],
        "cpu",
        steps=2,
        warmup=1,
    )
    assert [(r.mode, r.batch_size, r.status) for r in rows] == [
        ("fp32", 4, "ok"), ("fp32", 16, "OOM"), ("fp32", 8, "ok"),
        ("bf16", 4, "ok"), ("bf16", 16, "OOM"), ("bf16", 8, "ok"),
    ]
    oom = rows[1]
    assert (oom.median_seconds, oom.peak_memory_bytes, oom.loss, oom.steps_run) == (
        None, None, None, 0
    )


def test_sweep_lets_errors_other_than_oom_through():
    def broken_model() -> nn.Module:
        return nn.Linear(5, 3)  # the batch has 6 features: a shape bug, not a memory problem

    with pytest.raises(RuntimeError) as excinfo:
        P.precision_sweep(broken_model, P.random_batch_maker((6,)), ["fp32"], [4], "cpu", steps=1)
    assert not isinstance(excinfo.value, torch.OutOfMemoryError)


class _FailsLikeALibraryOutOfMemoryAt(nn.Linear):
    """Raises ``message`` at batch size 16, as cuDNN or CUDA do when the GPU is full."""

    def __init__(self, message: str) -> None:
        super().__init__(6, 3)
        self.message = message

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 16:
            raise RuntimeError(self.message)
        return super().forward(x)


# What cuBLAS, cuDNN and the CUDA runtime say when there is no memory left for a workspace
# or a handle: nothing in these messages is a torch.OutOfMemoryError.
@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. GET was unable to find an engine to "
        "execute this computation",
        "Unable to find a valid cuDNN algorithm to run convolution",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at "
        "some other API call, so the stacktrace below might be incorrect.",
    ],
)
def test_sweep_counts_library_out_of_memory_symptoms_as_oom(message):
    rows = P.precision_sweep(
        lambda: _FailsLikeALibraryOutOfMemoryAt(message),
        P.random_batch_maker((6,), num_classes=3),
        ["fp32"],
        [16, 4],
        "cpu",
        steps=1,
        warmup=0,
    )
    assert [(r.batch_size, r.status) for r in rows] == [(16, "OOM"), (4, "ok")]


def test_oom_check_knows_out_of_memory_from_other_errors():
    cuda_oom = torch.cuda.OutOfMemoryError  # the same class as torch.OutOfMemoryError
    assert P._is_out_of_memory(cuda_oom("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not P._is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_sweep_on_cpu_measures_fp32_and_bf16_and_explains_the_rest():
    make_batch = P.random_batch_maker((1, 4, 4), num_classes=3)
    rows = P.precision_sweep(
        lambda: P.sweep_mlp(16, 32, 2, num_classes=3),
        make_batch,
        P.PRECISION_MODES,
        [8, 12],
        "cpu",
        steps=3,
        warmup=2,
        lr=0.1,
    )
    by_mode = {m: [r for r in rows if r.mode == m] for m in P.PRECISION_MODES}
    assert [r.batch_size for r in rows] == [8, 12] * 4
    for mode in ("tf32", "fp16"):
        assert {r.status for r in by_mode[mode]} == {"needs CUDA"}
    for mode in ("fp32", "bf16"):
        for r in by_mode[mode]:
            assert r.ok and r.steps_run == 5 and r.peak_memory_bytes is None
            assert r.median_seconds > 0 and r.examples_per_second > 0

    # The last loss is the loss of the model after four SGD steps: recompute it by hand.
    torch.manual_seed(0)
    model = P.sweep_mlp(16, 32, 2, num_classes=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = make_batch(8, torch.device("cpu"))
    for _ in range(5):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    assert by_mode["fp32"][0].loss == pytest.approx(loss.item(), rel=1e-5)
    # bf16 keeps about 3 significant digits: close to fp32, not equal to it.
    assert by_mode["bf16"][0].loss == pytest.approx(loss.item(), abs=0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"modes": ["fp64"]}, "unknown: \\['fp64'\\]"),
        ({"modes": []}, "non-empty"),
        ({"batch_sizes": []}, "batch_sizes"),
        ({"batch_sizes": [8, 0]}, "batch_sizes"),
        ({"batch_sizes": [8.0]}, "batch_sizes"),
        ({"steps": 0}, "steps"),
    ],
)
def test_sweep_rejects_bad_arguments(kwargs, message):
    arguments = {"modes": ["fp32"], "batch_sizes": [4], "steps": 1}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        P.precision_sweep(lambda: nn.Linear(6, 3), P.random_batch_maker((6,)), device="cpu",
                          **arguments)


@pytest.mark.parametrize(
    ("mode", "device", "capability", "expected"),
    [
        ("fp32", "cpu", None, None),
        ("bf16", "cpu", None, None),
        ("tf32", "cpu", None, "needs CUDA"),
        ("fp16", "cpu", None, "needs CUDA"),
        ("fp16", "cuda", (6, 1), None),  # runs, just without Tensor Cores
        ("fp16", "cuda", (7, 5), None),
        ("tf32", "cuda", (7, 5), "needs compute capability 8.0 (this GPU: 7.5)"),
        ("bf16", "cuda", (7, 0), "needs compute capability 8.0 (this GPU: 7.0)"),
        ("tf32", "cuda", (8, 0), None),
        ("bf16", "cuda", (9, 0), None),
    ],
)
def test_mode_unavailable_reason(mode, device, capability, expected):
    assert P.mode_unavailable_reason(mode, device, capability) == expected


def _row(mode, batch, seconds, peak, status="ok"):
    return P.SweepRow(mode, batch, seconds, peak, 1.0 if seconds else None, 3, status)


def test_compare_uses_the_largest_batch_where_both_modes_ran():
    rows = [
        _row("fp32", 8, 2.0, 100),
        _row("fp32", 16, 4.0, 200),
        _row("fp32", 32, None, None, "OOM"),
        _row("bf16", 8, 0.5, 40),
        _row("bf16", 16, 1.0, 50),
        _row("bf16", 32, 2.0, 90),
    ]
    result = P.compare_sweep_modes(rows, "fp32", "bf16")
    assert (result.batch_size, result.speedup, result.memory_ratio) == (16, 4.0, 0.25)
    assert "4.00x" in result.describe() and "75% lower" in result.describe()
    # A mode that needs more says so, not "-50% lower".
    worse = dataclasses.replace(result, memory_ratio=1.5, saved_ratio=3.0)
    assert "50% higher" in worse.describe() and "200% more saved" in worse.describe()


def test_compare_without_memory_or_without_shared_batches():
    cpu_rows = [_row("fp32", 8, 3.0, None), _row("bf16", 8, 2.0, None)]
    result = P.compare_sweep_modes(cpu_rows)
    assert result.memory_ratio is None and result.speedup == 1.5
    assert "not measured" in result.describe()
    assert P.compare_sweep_modes([_row("fp32", 8, 3.0, None), _row("fp16", 8, None, None,
                                                                   "needs CUDA")], "fp32",
                                 "fp16") is None


def test_format_sweep_table_has_one_line_per_row_and_shows_failures():
    rows = [_row("fp32", 8, 0.002, 3 * 2**20), _row("fp16", 8, None, None, "OOM")]
    lines = P.format_sweep_table(rows).splitlines()
    assert len(lines) == 3
    assert "2.00" in lines[1] and "3.0" in lines[1] and lines[1].endswith("ok")
    assert lines[2].endswith("OOM")


def test_sweep_mlp_shape_and_depth():
    model = P.sweep_mlp(12, 20, 3, num_classes=5)
    assert sum(isinstance(m, nn.Linear) for m in model) == 4
    assert model(torch.randn(7, 3, 2, 2)).shape == (7, 5)


def test_random_batch_maker_is_deterministic_per_size():
    make = P.random_batch_maker((2, 3), num_classes=4, seed=7)
    (x1, y1), (x2, y2) = make(5, torch.device("cpu")), make(5, torch.device("cpu"))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (5, 2, 3) and y1.dtype == torch.int64 and int(y1.max()) < 4


# ---------------------------------------------------------------------------
# CUDA paths
# ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_fp16_autocast_keeps_reductions_and_norms_in_fp32():
    device = torch.device("cuda")
    layer = nn.Linear(16, 16).to(device)
    x = torch.randn(4, 16, device=device)
    with P.precision_policy(device, "fp16").autocast():
        hidden = layer(x)
        assert hidden.dtype == torch.float16
        assert torch.softmax(hidden, dim=-1).dtype == torch.float32
        assert nn.functional.layer_norm(hidden, (16,)).dtype == torch.float32
        assert hidden.sum().dtype == torch.float32


@pytest.mark.gpu
def test_cuda_auto_policy_matches_this_gpus_capability():
    capability = torch.cuda.get_device_capability(0)
    assert P.precision_policy("cuda:0") == P.precision_policy("cuda:0", capability=capability)


@pytest.mark.gpu
def test_cuda_sweep_measures_peak_memory():
    device = torch.device("cuda")
    width = 512
    model_bytes = sum(p.numel() * 4 for p in P.sweep_mlp(width, width, 2).parameters())
    modes = [m for m in P.PRECISION_MODES if P.mode_unavailable_reason(m, device) is None]
    rows = P.precision_sweep(
        lambda: P.sweep_mlp(width, width, 2), P.random_batch_maker((width,)), modes, [64, 256],
        device, steps=2, warmup=1,
    )
    assert all(r.ok for r in rows)
    for r in rows:
        # weights, their gradients and the batch at least were all allocated at once
        assert r.peak_memory_bytes >= 2 * model_bytes + r.batch_size * width * 4
        assert torch.isfinite(torch.tensor(r.loss))


@pytest.mark.gpu
def test_tf32_changes_cuda_matmul_results_only_from_capability_8():
    if torch.cuda.get_device_capability(0) < (8, 0):
        pytest.skip("TF32 needs compute capability 8.0; on this GPU the switch has no effect")
    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(1024, 1024, device="cuda", generator=generator)
    b = torch.randn(1024, 1024, device="cuda", generator=generator)
    exact = (a.double() @ b.double()).float()
    with P.tf32_matmuls(False):
        strict_error = (a @ b - exact).abs().max().item()
    with P.tf32_matmuls(True):
        tf32_error = (a @ b - exact).abs().max().item()
    assert tf32_error > 10 * strict_error  # 10-bit vs 23-bit mantissa


def test_plot_precision_sweep_draws_one_line_per_mode_that_ran():
    import dataclasses

    import matplotlib.pyplot as plt

    from d2lgpu.plotting import plot_precision_sweep

    gpu_rows = [
        _row("fp32", 8, 0.004, 300), _row("fp32", 16, 0.008, 500),
        _row("bf16", 8, 0.002, 200), _row("bf16", 16, None, None, "OOM"),
        _row("tf32", 8, None, None, "needs compute capability 8.0 (this GPU: 7.5)"),
    ]
    gpu_rows = [dataclasses.replace(r, saved_activation_bytes=2**20 if r.ok else None)
                for r in gpu_rows]
    fig = plot_precision_sweep(gpu_rows)
    time_ax, saved_ax, memory_ax = fig.axes
    assert [line.get_label() for line in time_ax.lines] == ["fp32", "bf16"]
    assert list(time_ax.lines[0].get_ydata()) == pytest.approx([4.0, 8.0])  # milliseconds
    assert list(saved_ax.lines[0].get_ydata()) == pytest.approx([1.0, 1.0])  # MiB
    assert len(memory_ax.lines) == 2 and "peak GPU" in memory_ax.get_title()
    plt.close(fig)

    # A CPU run: no peak memory, but the saved bytes are counted and plotted.
    cpu_rows = [dataclasses.replace(_row(m, 8, 0.004, None), saved_activation_bytes=n)
                for m, n in (("fp32", 2**21), ("bf16", 2**20))]
    fig = plot_precision_sweep(cpu_rows)
    assert len(fig.axes) == 2 and "saved" in fig.axes[1].get_title()
    assert [list(line.get_ydata()) for line in fig.axes[1].lines] == [[2.0], [1.0]]
    plt.close(fig)
    # Rows without either memory figure give the time panel alone.
    fig = plot_precision_sweep([_row("fp32", 8, 0.004, None)])
    assert len(fig.axes) == 1
    plt.close(fig)


# ---------------------------------------------------------------------------
# Mixed-precision training end to end (d2lgpu.train_fast uses the policy)
# ---------------------------------------------------------------------------


def _blobs(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Three well-separated Gaussian clusters in 8 dimensions: a problem any model solves."""
    generator = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.eye(3, 8)
    labels = torch.randint(0, 3, (n,), generator=generator)
    features = centres[labels] + 0.5 * torch.randn(n, 8, generator=generator)
    return torch.utils.data.TensorDataset(features, labels)


@pytest.mark.parametrize("precision", ["bf16", "auto", "fp16"])
def test_mixed_precision_training_on_cpu_converges(precision):
    from d2lgpu.fast import Techniques, train_fast

    loader = torch.utils.data.DataLoader
    train_iter = loader(_blobs(512, 0), batch_size=64, shuffle=True)
    test_iter = loader(_blobs(256, 1), batch_size=128)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    history = train_fast(net, train_iter, test_iter, num_epochs=4, lr=0.2, device="cpu", seed=0,
                         techniques=Techniques(precision=precision), progress=False)
    assert history.train_loss[-1] < 0.5 * history.train_loss[0]
    assert history.test_acc[-1] > 0.95  # chance is 1/3
    assert all(p.dtype == torch.float32 for p in net.parameters())  # master weights stay fp32


@pytest.mark.parametrize(
    ("device", "capability", "mode"),
    [("cpu", None, "bf16"), ("cuda", (6, 1), "fp16"), ("cuda", (7, 5), "fp16"),
     ("cuda", (8, 0), "bf16"), ("cuda", (9, 0), "bf16")],
)
def test_amp_sweep_mode_follows_the_auto_policy(device, capability, mode):
    assert P.amp_sweep_mode(device, capability) == mode


# ---------------------------------------------------------------------------
# The CPU rule: decided from the flags the CPU reports, both branches tested
# ---------------------------------------------------------------------------

_X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
_X86_PLAIN = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
_X86_AMX = "processor\t: 0\nflags\t\t: fpu avx512f amx_tile amx_bf16 amx_int8\n"
_ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve i8mm bf16\n"
_ARM_PLAIN = "processor\t: 0\nFeatures\t: fp asimd\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [(_X86_BF16, True), (_X86_AMX, True), (_ARM_BF16, True), (_X86_PLAIN, False),
     (_ARM_PLAIN, False)],
)
def test_cpu_bf16_is_read_from_the_flags_the_cpu_reports(tmp_path, monkeypatch, cpuinfo, native):
    monkeypatch.delenv("D2LGPU_CPU_BF16", raising=False)  # CI sets it in one of its jobs
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert P.cpu_has_native_bf16(str(path)) is native


def test_cpu_bf16_is_false_where_the_flags_cannot_be_read(tmp_path, monkeypatch):
    monkeypatch.delenv("D2LGPU_CPU_BF16", raising=False)
    missing = str(tmp_path / "no-such-file")
    assert P.cpu_flags(missing) is None
    assert P.cpu_has_native_bf16(missing) is False


@pytest.mark.parametrize("native", [True, False])
def test_auto_policy_on_cpu_follows_the_flags_and_the_override(monkeypatch, tmp_path, native):
    monkeypatch.delenv("D2LGPU_CPU_BF16", raising=False)
    path = tmp_path / "cpuinfo"
    path.write_text(_X86_BF16 if native else _X86_PLAIN)
    real = P.cpu_has_native_bf16
    monkeypatch.setattr(P, "cpu_has_native_bf16", lambda: real(str(path)))
    expected = torch.bfloat16 if native else None
    assert P.precision_policy("cpu", "auto").dtype == expected
    # The override gives both rows of chapter 6's table on any machine.
    assert P.precision_policy("cpu", "auto", cpu_native_bf16=True).name == "bf16"
    assert P.precision_policy("cpu", "auto", cpu_native_bf16=False).name == "fp32"
    assert P.precision_policy("cpu", "bf16", cpu_native_bf16=False).name == "bf16"  # forced


@pytest.mark.parametrize(
    "value, native", [("1", True), ("0", False), ("yes", True), ("off", False)]
)
@pytest.mark.parametrize("cpuinfo", [_X86_BF16, _X86_PLAIN])
def test_the_environment_overrides_the_cpu_flags_and_auto_follows(
    monkeypatch, tmp_path, value, native, cpuinfo
):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    monkeypatch.setenv("D2LGPU_CPU_BF16", value)
    assert P.cpu_has_native_bf16(str(path)) is native  # whatever the flags say
    assert P.cpu_has_native_bf16() is native  # and this machine's
    assert P.precision_policy("cpu", "auto").name == ("bf16" if native else "fp32")


def test_a_misspelt_cpu_bf16_override_is_an_error_not_a_guess(monkeypatch):
    monkeypatch.setenv("D2LGPU_CPU_BF16", "maybe")
    with pytest.raises(ValueError, match="D2LGPU_CPU_BF16='maybe' is not understood"):
        P.cpu_has_native_bf16()


# ---------------------------------------------------------------------------
# Nonsense refused with the fix named
# ---------------------------------------------------------------------------


def _tiny_sweep(**kwargs):
    args = dict(model_fn=lambda: P.sweep_mlp(16, 8, 1, num_classes=3),
                make_batch=P.random_batch_maker((16,), num_classes=3), modes=["fp32"],
                batch_sizes=[4], device="cpu", steps=2, warmup=1)
    args.update(kwargs)
    return P.precision_sweep(**args)


def test_sweep_stops_when_training_diverges_like_train_does():
    with pytest.raises(FloatingPointError, match=r"diverged\. Try a smaller learning rate"):
        _tiny_sweep(lr=1e6, steps=5)


class _GrowingWrongLogit(nn.Linear):
    """Pushes class 1's logit up by 100 a step, every label being 0: a finite loss that grows."""

    def __init__(self) -> None:
        super().__init__(16, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        push = torch.tensor([0.0, 100.0 * (self.calls - 1), 0.0])
        return super().forward(x) + push


def test_sweep_stops_a_loss_that_grows_tenfold_but_stays_finite():
    def all_class_0(batch_size, device):
        features, labels = P.random_batch_maker((16,), num_classes=3)(batch_size, device)
        return features, torch.zeros_like(labels)

    with pytest.raises(FloatingPointError, match=r"ended with loss .* from .* at the first: "
                                                 r"training diverged"):
        _tiny_sweep(model_fn=_GrowingWrongLogit, make_batch=all_class_0, steps=3)


def test_sweep_blames_nan_in_the_data_not_the_lr():
    def nan_batch(batch_size, device):
        features, labels = P.random_batch_maker((16,), num_classes=3)(batch_size, device)
        features[0, 0] = float("nan")
        return features, labels

    with pytest.raises(ValueError, match="holds NaN or inf: the data is broken"):
        _tiny_sweep(make_batch=nan_batch)


def test_sweep_blames_nan_in_the_initial_weights():
    def broken() -> nn.Module:
        model = P.sweep_mlp(16, 8, 1, num_classes=3)
        with torch.no_grad():
            model[1].weight[0, 0] = float("nan")
        return model

    with pytest.raises(ValueError, match="weights hold NaN"):
        _tiny_sweep(model_fn=broken)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"baseline": "fp64"}, ValueError, "not a sweep mode"),
     ({"candidate": "int8"}, ValueError, "not a sweep mode"),
     ],
)
def test_compare_refuses_unknown_modes_and_wrong_rows(kwargs, error, match):
    args = {"rows": [], "baseline": "fp32", "candidate": "bf16"} | kwargs
    with pytest.raises(error, match=match):
        P.compare_sweep_modes(**args)


# ---------------------------------------------------------------------------
# Repeats: the modes take turns, and the verdict comes from the paired repeats
# ---------------------------------------------------------------------------


def test_repeats_interleave_the_modes_of_each_batch_size(monkeypatch):
    order = []
    times = iter([0.10, 0.05, 0.30, 0.05, 0.11, 0.04,  # batch 8: fp32, bf16 x 3 repeats
                  0.20, 0.10, 0.21, 0.09, 0.19, 0.11])  # batch 16

    def fake_measure(model_fn, make_batch, mode, batch_size, *rest):
        order.append((mode, batch_size))
        t = next(times)
        return P.SweepRow(mode, batch_size, t, None, 1.0, 3, "ok", (t,))

    monkeypatch.setattr(P, "_measure_one", fake_measure)
    rows = P.precision_sweep(lambda: None, lambda b, d: None, ["fp32", "tf32", "bf16"], [8, 16],
                             "cpu", repeats=3)
    assert order == [("fp32", 8), ("bf16", 8)] * 3 + [("fp32", 16), ("bf16", 16)] * 3
    assert [(r.mode, r.batch_size, r.status) for r in rows] == [
        ("fp32", 8, "ok"), ("fp32", 16, "ok"), ("tf32", 8, "needs CUDA"),
        ("tf32", 16, "needs CUDA"), ("bf16", 8, "ok"), ("bf16", 16, "ok")]
    fp32_8 = rows[0]
    assert fp32_8.repeat_seconds == (0.10, 0.30, 0.11)
    assert fp32_8.median_seconds == 0.11  # the median: the 0.30 burst does not move it
    comparison = P.compare_sweep_modes(rows, "fp32", "bf16")
    assert comparison.batch_size == 16
    assert comparison.repeat_speedups == pytest.approx((2.0, 0.21 / 0.09, 0.19 / 0.11))
    assert comparison.speedup == pytest.approx(0.20 / 0.10)


def test_a_row_out_of_memory_once_is_not_measured_again(monkeypatch):
    calls = []

    def fake_measure(model_fn, make_batch, mode, batch_size, *rest):
        calls.append((mode, batch_size))
        if mode == "bf16":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return P.SweepRow(mode, batch_size, 0.1, None, 1.0, 3, "ok", (0.1,))

    monkeypatch.setattr(P, "_measure_one", fake_measure)
    rows = P.precision_sweep(lambda: None, lambda b, d: None, ["fp32", "bf16"], [8], "cpu",
                             repeats=3)
    assert calls == [("fp32", 8), ("bf16", 8), ("fp32", 8), ("fp32", 8)]
    assert [r.status for r in rows] == ["ok", "OOM"]
    assert rows[0].repeat_seconds == (0.1, 0.1, 0.1)


# ---------------------------------------------------------------------------
# The torch.amp recipe written out equals the package's sweep step
# ---------------------------------------------------------------------------


def _recipe_problem():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    generator = torch.Generator().manual_seed(1)
    return net, torch.randn(16, 16, generator=generator), torch.randint(0, 5, (16,),
                                                                        generator=generator)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_plain_autocast_recipe_and_the_sweep_reach_the_same_loss(mode):
    net, x, y = _recipe_problem()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
    rows = P.precision_sweep(lambda: _recipe_problem()[0], lambda b, d: _recipe_problem()[1:],
                             [mode], [16], "cpu", steps=3, warmup=1, lr=0.1)
    assert rows[0].steps_run == 4
    assert rows[0].loss == pytest.approx(loss.item(), abs=1e-6)


def test_plain_fp16_grad_scaler_recipe_trains_on_the_cpu():
    net, x, y = _recipe_problem()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert scaler.get_scale() == 2.0**16  # no overflow in this small problem: no back-off


# ---------------------------------------------------------------------------
# Saved-activation bytes: the memory a CPU can count
# ---------------------------------------------------------------------------


def test_the_counter_counts_what_a_linear_relu_stack_saves_once_per_storage():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    features, labels = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    with P.SavedActivations(exclude=list(model.parameters())) as counter:
        nn.functional.cross_entropy(model(features), labels)
    # fp32: the input (5x4), the ReLU output (5x8; saved by ReLU and by the second linear,
    # counted once), the logits' softmax for the loss (5x3) and small loss buffers.
    assert counter.nbytes >= 4 * (5 * 4 + 5 * 8 + 5 * 3)
    assert counter.nbytes < 4 * (5 * 4 + 2 * 5 * 8 + 3 * 5 * 3) + 256
    policy = P.precision_policy("cpu", "fp32")
    assert P.saved_activation_bytes(model, features, labels, policy) == counter.nbytes


def test_the_counter_leaves_out_the_parameters_and_grows_with_the_batch():
    torch.manual_seed(0)
    model = P.sweep_cnn(widths=(4, 8))
    make = P.random_batch_maker((1, 16, 16))
    fp32, bf16 = P.precision_policy("cpu", "fp32"), P.precision_policy("cpu", "bf16")
    counts = {(name, b): P.saved_activation_bytes(model, *make(b, torch.device("cpu")), policy)
              for b in (2, 4, 8) for name, policy in (("fp32", fp32), ("bf16", bf16))}
    for name in ("fp32", "bf16"):
        step = counts[name, 4] - counts[name, 2]
        assert step > 0 and counts[name, 8] - counts[name, 4] == pytest.approx(2 * step, rel=0.05)
    assert counts["bf16", 8] < counts["fp32", 8]
    everything = P.SavedActivations()
    with everything:
        model(make(2, torch.device("cpu"))[0]).sum()
    assert everything.nbytes > counts["fp32", 2] - 4 * 2 * 10  # parameters counted now


def test_sweep_rows_record_saved_bytes_and_the_table_shows_them():
    # Batches large enough that activations, not autocast's 16-bit weight copies, dominate.
    rows = P.precision_sweep(lambda: P.sweep_mlp(8, 16, 2), P.random_batch_maker((8,)),
                             ["fp32", "bf16"], [64, 128], "cpu", steps=1, warmup=1)
    saved = {(r.mode, r.batch_size): r.saved_activation_bytes for r in rows}
    assert all(v is not None and v > 0 for v in saved.values())
    assert saved["fp32", 128] > saved["fp32", 64] and saved["bf16", 128] < saved["fp32", 128]
    assert all(r.steps_run == 2 for r in rows)  # the counted step is the warm-up step
    table = P.format_sweep_table(rows)
    assert "saved MiB" in table.splitlines()[0]
    no_warmup = P.precision_sweep(lambda: P.sweep_mlp(8, 16, 2), P.random_batch_maker((8,)),
                                  ["fp32"], [64], "cpu", steps=1, warmup=0)
    assert no_warmup[0].steps_run == 1
    assert no_warmup[0].saved_activation_bytes == saved["fp32", 64]


def test_sweep_cnn_takes_any_image_of_16_pixels_or_more():
    model = P.sweep_cnn(widths=(4, 8, 16))
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 10)
    assert sum(isinstance(m, nn.Conv2d) for m in model) == 3


def test_has_fp32_precision_api_reads_what_this_torch_offers(monkeypatch):
    assert P.has_fp32_precision_api() is hasattr(torch.backends.cuda.matmul, "fp32_precision")

    class OldMatmul:  # a torch before the fp32_precision switches
        allow_tf32 = False

    monkeypatch.setattr(torch.backends.cuda, "matmul", OldMatmul())
    assert P.has_fp32_precision_api() is False


# --- a sweep row beside the plain loop (chapter 6), with rows shaped like a GPU's -----------



def test_sweep_trains_with_the_optimizer_it_is_given_and_can_show_progress(capsys):
    make_batch = P.random_batch_maker((16,), num_classes=3)

    def adam(parameters):
        return torch.optim.Adam(parameters, lr=1e-2)

    rows = P.precision_sweep(lambda: P.sweep_mlp(16, 32, 2, num_classes=3), make_batch,
                             ["fp32"], [8], "cpu", steps=2, warmup=2, make_optimizer=adam,
                             progress=True)
    torch.manual_seed(0)
    model = P.sweep_mlp(16, 32, 2, num_classes=3)
    optimizer = adam(model.parameters())
    x, y = make_batch(8, torch.device("cpu"))
    for _ in range(4):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    assert rows[0].loss == pytest.approx(loss.item(), rel=1e-5)
    assert "sweep rows" in capsys.readouterr().err  # tqdm's text bar outside Jupyter
