"""Tests of d2lgpu.runtime.config: quick mode, pick, the data root and the mode line."""

from pathlib import Path

import pytest

from d2lgpu.runtime import config


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", " on "])
def test_quick_mode_on(monkeypatch, value):
    monkeypatch.setenv("D2LGPU_QUICK", value)
    assert config.quick_mode() is True


@pytest.mark.parametrize("value", ["0", "", "false", "No", "off"])
def test_quick_mode_off(monkeypatch, value):
    monkeypatch.setenv("D2LGPU_QUICK", value)
    assert config.quick_mode() is False


def test_quick_mode_unset_means_full(monkeypatch):
    monkeypatch.delenv("D2LGPU_QUICK", raising=False)
    assert config.quick_mode() is False


@pytest.mark.parametrize("value", ["maybe", "2", "quick"])
def test_quick_mode_rejects_unknown_values(monkeypatch, value):
    monkeypatch.setenv("D2LGPU_QUICK", value)
    with pytest.raises(ValueError, match="D2LGPU_QUICK") as excinfo:
        config.quick_mode()
    # The message shows the bad value and how to fix it.
    assert repr(value) in str(excinfo.value)
    assert "set it to 1" in str(excinfo.value)


def test_pick_propagates_bad_quick_value(monkeypatch):
    monkeypatch.setenv("D2LGPU_QUICK", "maybe")
    with pytest.raises(ValueError, match="D2LGPU_QUICK"):
        config.pick(full=10, quick=1)


def test_data_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("D2LGPU_DATA", str(tmp_path))
    assert config.data_root() == tmp_path


def test_data_root_expands_user(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("D2LGPU_DATA", "~/datasets")
    assert config.data_root() == tmp_path / "datasets"


@pytest.mark.parametrize("value", [None, "", "   "])
def test_data_root_defaults_to_cache(monkeypatch, tmp_path, value):
    if value is None:
        monkeypatch.delenv("D2LGPU_DATA", raising=False)
    else:
        monkeypatch.setenv("D2LGPU_DATA", value)
    monkeypatch.setattr(config, "default_cache_dir", lambda: tmp_path / "cache")
    assert config.data_root() == tmp_path / "cache" / "data"


def test_default_cache_dir_honours_xdg_on_linux(monkeypatch, tmp_path):
    monkeypatch.setattr(config.sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert config.default_cache_dir() == tmp_path / "d2lgpu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert config.default_cache_dir() == Path.home() / ".cache" / "d2lgpu"


@pytest.fixture
def no_workload_env(monkeypatch):
    monkeypatch.delenv("D2LGPU_QUICK", raising=False)
    monkeypatch.delenv("D2LGPU_FULL", raising=False)
    monkeypatch.delenv("D2LGPU_SMOKE", raising=False)
    return monkeypatch


@pytest.mark.parametrize("gpu", [True, False])
def test_default_workload_follows_the_hardware(no_workload_env, gpu):
    no_workload_env.setattr(config, "_cuda_usable", lambda: gpu)
    assert config.workload() == ("full" if gpu else "cpu")


def test_full_forces_the_real_workload_on_a_cpu(no_workload_env):
    no_workload_env.setattr(config, "_cuda_usable", lambda: False)
    no_workload_env.setenv("D2LGPU_FULL", "1")
    assert config.workload() == "full"
    assert config.describe_mode().startswith("full mode on a CPU")
    assert "hours" in config.describe_mode()


def test_quick_wins_over_full(no_workload_env):
    no_workload_env.setenv("D2LGPU_FULL", "1")
    no_workload_env.setenv("D2LGPU_QUICK", "1")
    assert config.workload() == "quick"


def test_full_rejects_unknown_values(no_workload_env):
    no_workload_env.setenv("D2LGPU_FULL", "please")
    with pytest.raises(ValueError, match="D2LGPU_FULL='please'"):
        config.workload()


@pytest.mark.parametrize(
    ("quick", "gpu", "expected"),
    [("1", False, "q"), ("0", True, "f"), ("0", False, "c")],
)
def test_pick_chooses_by_workload(no_workload_env, quick, gpu, expected):
    no_workload_env.setenv("D2LGPU_QUICK", quick)
    no_workload_env.setattr(config, "_cuda_usable", lambda: gpu)
    assert config.pick(full="f", quick="q", cpu="c") == expected


@pytest.mark.parametrize("gpu", [True, False])
def test_smoke_mode_takes_full_modes_choices_and_quick_amounts(no_workload_env, gpu):
    no_workload_env.setattr(config, "_cuda_usable", lambda: gpu)
    no_workload_env.setenv("D2LGPU_SMOKE", "1")
    assert config.workload() == "full"  # every `if workload() == "full"` branch is taken
    assert config.smoke_mode() and config.small_data()
    # Choices come from full mode: models, flags, words, switches.
    assert config.pick(full="resnet18", quick="small_cnn", cpu="small_cnn") == "resnet18"
    assert config.pick(full=True, quick=False, cpu=False) is True
    assert config.pick(full=None, quick="quick mode", cpu="CPU mode") is None
    # Amounts come from quick mode: numbers, and lists, tuples and dicts of them.
    assert config.pick(full=60_000, quick=1_000, cpu=3_000) == 1_000
    assert config.pick(full=0.5, quick=0.05) == 0.05
    assert config.pick(full=[256, 65536], quick=[16, 64], cpu=[16]) == [16, 64]
    assert config.pick(full=(10, 3), quick=(2, 1)) == (2, 1)
    assert config.pick(full=dict(width=2048), quick=dict(width=64)) == dict(width=64)
    # A choice that is itself an amount of work says so.
    assert config.pick(full="--full", quick="--quick", smoke="--quick") == "--quick"
    assert config.describe_mode().startswith("smoke mode")


def test_quick_wins_over_smoke(no_workload_env):
    no_workload_env.setenv("D2LGPU_SMOKE", "1")
    no_workload_env.setenv("D2LGPU_QUICK", "1")
    assert config.workload() == "quick" and not config.smoke_mode()
    assert config.small_data()
    assert config.pick(full="f", quick="q", smoke="s") == "q"


@pytest.mark.parametrize("gpu", [True, False])
def test_the_smoke_value_is_only_for_smoke_mode(no_workload_env, gpu):
    no_workload_env.setattr(config, "_cuda_usable", lambda: gpu)
    assert config.pick(full="f", quick="q", cpu="c", smoke="s") == ("f" if gpu else "c")


def test_smoke_rejects_unknown_values(no_workload_env):
    no_workload_env.setenv("D2LGPU_SMOKE", "sure")
    with pytest.raises(ValueError, match="D2LGPU_SMOKE='sure'"):
        config.workload()


def test_pick_without_cpu_value_uses_full_on_a_cpu(no_workload_env):
    no_workload_env.setattr(config, "_cuda_usable", lambda: False)
    assert config.pick(full=10, quick=1) == 10
    # None is a value like any other, not "missing".
    assert config.pick(full=10, quick=1, cpu=None) is None


@pytest.mark.parametrize(
    ("quick", "gpu", "start"),
    [("1", False, "quick mode"), ("0", True, "full mode:"), ("0", False, "CPU mode")],
)
def test_describe_mode_names_the_workload(no_workload_env, quick, gpu, start):
    no_workload_env.setenv("D2LGPU_QUICK", quick)
    no_workload_env.setattr(config, "_cuda_usable", lambda: gpu)
    assert config.describe_mode().startswith(start)
