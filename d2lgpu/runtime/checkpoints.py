"""Distributed checkpoints that a run can trust and resume from: torch.distributed.checkpoint
(DCP) directories, one per step, with a SHA-256 of every file, an atomic rename, and errors
that name the damage and the way on. Chapter 8 writes the plain DCP calls in its cells, and
its FSDP run saves through :class:`Checkpoints`; the entry points resume through
:func:`resume_latest` (``fsdp_train`` and ``model_parallel_train`` by their Checkpoints hooks)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from d2lgpu.runtime.checks import check_writable_path

__all__ = [
    "CheckpointError",
    "Checkpoints",
    "Resumed",
    "check_resumable",
    "latest_checkpoint",
    "load_checkpoint",
    "prepare_checkpoint_root",
    "read_checkpoint_extra",
    "resume_latest",
    "save_checkpoint",
]

_STEP_PREFIX = "step-"
_CHECKSUMS = "checksums.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, trusted, or continued from under this run's settings."""


def _start_fresh(root: Path) -> str:
    return f"to start fresh, delete {root} or pass another checkpoint directory"


def prepare_checkpoint_root(root: str | Path) -> Path:
    """Create ``root`` where checkpoints can be written: called before any training."""
    try:
        root = check_writable_path("the checkpoint directory", root, kind="directory")
        root.mkdir(parents=True, exist_ok=True)
    except (ValueError, TypeError, OSError) as exc:  # TypeError: not a path, or an empty one
        raise CheckpointError(f"cannot write checkpoints: {exc}") from None
    return root


def _file_digests(directory: Path) -> dict[str, str]:
    """SHA-256 of every file in a checkpoint directory but the list of digests itself."""
    digests = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != _CHECKSUMS:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            digests[path.name] = digest.hexdigest()
    return digests


def _checkpoint_damage(path: Path) -> str | None:
    """What is wrong with the checkpoint directory ``path``, or None when every file matches
    the checksums :func:`save_checkpoint` wrote with it."""
    if not (path / ".metadata").exists():
        return "has no .metadata (the map of its shards): it was damaged after it was written"
    try:
        expected = dict(json.loads((path / _CHECKSUMS).read_text()))
    except (OSError, TypeError, ValueError):
        return f"has no readable {_CHECKSUMS}: it was not written by save_checkpoint, or damaged"
    actual = _file_digests(path)
    for name in sorted(set(expected) | set(actual)):
        if actual.get(name) != expected.get(name):
            return f"file {name} is missing, added or changed since it was written (checksums)"
    return None


def _step_of(path: Path) -> int | None:
    """The step of a checkpoint directory named ``step-NNNNNN``, else None."""
    digits = path.name.removeprefix(_STEP_PREFIX)
    if path.name.startswith(_STEP_PREFIX) and digits.isdigit() and path.is_dir():
        return int(digits)
    return None


def _verify_checkpoint(path: Path) -> None:
    """Refuse a damaged checkpoint, naming the damage and the newest intact one before it."""
    damage = _checkpoint_damage(path)
    if damage is None:
        return
    step = _step_of(path)
    earlier = sorted((p for p in path.parent.iterdir() if step is not None
                      and (s := _step_of(p)) is not None and s < step), key=_step_of, reverse=True)
    # newest first, hashing no further than the first intact one
    intact = next((p for p in earlier if _checkpoint_damage(p) is None), None)
    fresh = _start_fresh(path.parent)
    if intact is not None:
        way_on = (
            f"Delete {path} to resume from {intact.name}, the newest "
            f"intact checkpoint before it; or, {fresh}"
        )
    else:
        way_on = f"No intact checkpoint comes before it: {fresh}"
    raise CheckpointError(f"checkpoint {path} {damage}. {way_on}")


def read_checkpoint_extra(path: str | Path) -> dict[str, Any]:
    """The ``extra.json`` of a checkpoint (its step, losses, settings), once every file of
    it checks out against its checksums."""
    _verify_checkpoint(Path(path))
    return json.loads((Path(path) / "extra.json").read_text())


def check_resumable(extra: dict[str, Any], config: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint written under other settings; ``config``'s keys name each one."""
    old = extra.get("config") or {}  # none recorded: every setting differs
    differences = [
        f"{key} {old.get(key)} in the checkpoint, {value} now"
        for key, value in config.items()
        if old.get(key) != value
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was written with other settings ({'; '.join(differences)}); "
            "resuming would continue its model and optimizer under the new ones. Rerun with the "
            f"checkpoint's settings; or, {_start_fresh(path.parent)}"
        )


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@contextlib.contextmanager
def _quiet_dcp():
    # Without a process group DCP warns that it assumes one process; here it is meant.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*(unavailable|uninit)")
        yield


def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> Path:
    """Write model and optimizer to ``root/step-NNNNNN`` with torch.distributed.checkpoint.

    A collective: every rank writes its own shards. Rank 0 adds ``extra`` (JSON; with the
    state of ``scaler`` when it scales the loss) and the SHA-256 of every file, and renames
    the temporary directory once all ranks are done, so a directory named ``step-*`` is always
    complete.
    """
    extra = dict(extra or {})
    if scaler is not None and scaler.is_enabled():
        extra["scaler"] = scaler.state_dict()
    # ~ expanded on every rank, as prepare_checkpoint_root expands it on rank 0
    root = prepare_checkpoint_root(root) if _is_main() else Path(root).expanduser()
    final = root / f"{_STEP_PREFIX}{step:06d}"
    tmp = root / f".{final.name}.tmp"
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    with _quiet_dcp():
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    if _is_main():
        (tmp / "extra.json").write_text(json.dumps({"step": step, **extra}))
        (tmp / _CHECKSUMS).write_text(json.dumps(_file_digests(tmp), indent=1))
        shutil.rmtree(final, ignore_errors=True)  # the same step saved again after a restart
        os.replace(tmp, final)  # atomic: the name appears only when complete
    if dist.is_initialized():
        dist.barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint of the highest step under ``root``, or None when there is none (chapter 8).

    Entries that only look like checkpoints (``step-abc``) are an error when they are all there
    is: a resumed run must never start from scratch without a word.
    """
    root = Path(root).expanduser()
    entries = list(root.iterdir()) if root.is_dir() else []
    done = [p for p in entries if _step_of(p) is not None]
    lookalikes = sorted(
        p.name
        for p in entries
        if p not in done and (p.name.startswith(_STEP_PREFIX) or p.name.endswith(".distcp"))
    )
    if lookalikes and not done:
        raise CheckpointError(
            f"{root} holds {len(lookalikes)} entries that look like checkpoints but are not "
            f"({', '.join(lookalikes[:5])}), and no checkpoint, so a resumed run would start "
            f"from scratch: save_checkpoint writes directories named {_STEP_PREFIX}NNNNNN. "
            f"Move them away if they are another tool's; or, {_start_fresh(root)}"
        )
    return max(done, key=_step_of, default=None)


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint` into ``model`` and ``optimizer``, sharded
    over any number of ranks or plain, once its checksums check out; return its extra
    (chapter 8)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is no checkpoint directory: see latest_checkpoint()")
    extra = read_checkpoint_extra(path)
    _load_verified(path, model, optimizer)
    return extra


def _load_verified(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a checkpoint whose checksums were checked: into each rank's own shards."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    _check_checkpoint_fits(path, state["model"])
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


class Resumed(NamedTuple):
    """What :func:`resume_latest` continued from."""

    step: int  # the step to continue from: 0 when there was no checkpoint yet
    extra: dict[str, Any]  # the checkpoint's extra.json ({} when none)
    path: Path | None


def resume_latest(
    root: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: dict[str, Any],
    *,
    end: int,
    scaler: torch.amp.GradScaler | None = None,
) -> Resumed:
    """Continue from the newest checkpoint under ``root``, if there is one: refuse it when it
    is damaged, written under settings other than ``config`` or at step ``end`` (where this
    run ends) or later; else load model, optimizer and the state of ``scaler``, if it was
    saved. Each file is hashed once."""
    path = latest_checkpoint(root)
    if path is None:
        return Resumed(0, {}, None)
    extra = read_checkpoint_extra(path)  # damage named first, before the settings
    check_resumable(extra, config, path)
    if extra["step"] >= end:
        raise CheckpointError(
            f"checkpoint {path} is at step {extra['step']} and this run ends at step {end}: "
            "nothing is left to train. Ask for more steps or epochs (they count from the start, "
            f"not from the checkpoint); or, {_start_fresh(path.parent)}"
        )
    _load_verified(path, model, optimizer)
    if scaler is not None and "scaler" in extra:
        scaler.load_state_dict(extra["scaler"])
    return Resumed(extra["step"], extra, path)


@dataclass
class Checkpoints:
    """The hooks that make a training loop resumable (chapter 8's ``FSDPRun``, chapter 9's
    ``TwoDRun``, the entry points): it continues from the newest checkpoint under ``root``
    and saves one every ``every`` steps and after the last, recording the run's settings and
    ``config`` (more settings, e.g. a command line's precision word); ``root`` None: neither.
    """

    root: str | None
    every: int = 1
    config: dict[str, Any] = field(default_factory=dict)

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
               settings: dict[str, Any], end: int) -> Resumed:
        """Called before the first step; a bad ``root`` is refused before any training."""
        if self.root is None:
            return Resumed(0, {}, None)
        root = prepare_checkpoint_root(self.root)
        return resume_latest(root, model, optimizer, {**settings, **self.config},
                             end=end, scaler=scaler)

    def after_forward(self, step: int) -> None:
        """Called between the forward and the backward of ``step`` (the entry points make a
        rank fail here)."""

    def after_step(self, done: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: Any, settings: dict[str, Any], end: int,
                   extra: dict[str, Any]) -> Path | None:
        """Called after step ``done`` (counted from 1) with its loss checked: saves when one
        is due (``extra``: the losses so far, the ranks), returning where."""
        if self.root is None or (done % self.every and done != end):
            return None
        extra = {**extra, "config": {**settings, **self.config}}
        return save_checkpoint(self.root, done, model, optimizer, extra, scaler=scaler)


def _check_checkpoint_fits(path: Path, model_state: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model, naming what differs (DCP's own error names no
    parameter)."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    parts = []
    for name, value in model_state.items():
        entry = saved.get(f"model.{name}")
        if not isinstance(value, torch.Tensor):
            continue
        if entry is None:
            parts.append(f"this model's {name} is not in it")
        elif tuple(getattr(entry, "size", value.shape)) != tuple(value.shape):
            parts.append(
                f"{name} is {tuple(entry.size)} in the checkpoint, "
                f"{tuple(value.shape)} in this model"
            )
    if parts:
        raise CheckpointError(
            f"checkpoint {path} holds another model: {'; '.join(parts[:6])}. "
            "Build the model with the settings it was saved with (its "
            f"extra.json records them); or, {_start_fresh(path.parent)}"
        )
