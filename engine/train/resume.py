"""Resuming a run: which checkpoint, which settings win (docs/resume-and-faults.md), and the state put back.

The model is the checkpoint's (every recorded ``model.*`` key but those that say how to run); everything else comes
from the command line and is applied, every difference listed in one warning. ``resume=auto`` takes this run
directory's checkpoint.pth, else the newest ``outputs/*/*/checkpoint.pth`` of a run whose settings differ only in
the schedule's length and how to run (the roles of engine/config/train_schema.py).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from datasets import ImageReadError
from datasets.loader import is_worker_death, worker_error_message
from engine.checkpoint.contents import (
    check_training_state,
    load_model_weights,
    put_recorded_model,
    read_recorded_config,
)
from engine.checkpoint.io import LATEST, load_checkpoint
from engine.config.registry import plain_config
from engine.config.run_files import named_checkpoint
from engine.config.train_schema import HOW_TO_RUN, INVOCATION, LENGTH, role_of, upgrade_recorded_config
from engine.errors import CheckpointError, LoaderWorkerDied, NonFiniteLossError
from models.model_config import MODEL_KEYS

from .optim import group_base_lrs
from .run_plan import Position

log = logging.getLogger(__name__)
# The lr schedule as the optimizer and the scheduler hold it; a change to any of these is applied on resume.
SCHEDULE_KEYS = ("lr", "lr_backbone", "lr_linear_proj_mult", "weight_decay", "lr_drop", "lr_gamma")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _kept_from_checkpoint(key: str) -> bool:
    group, _, name = key.partition(".")
    return group == "model" and name in MODEL_KEYS and role_of(key) != HOW_TO_RUN


def resumable_change(key: str) -> bool:
    """Whether a setting may differ from a checkpoint's without making it another run's (resume=auto): a longer
    schedule, and how to run. Any other difference (model, data, batch, seed, lr ...) is another experiment."""
    return role_of(key) in (HOW_TO_RUN, LENGTH)


def setting_differences(recorded: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, command line's value) for every setting both record with another value (``recorded``
    in this version's layout: upgrade_recorded_config); a null model.num_classes on the command line ("from the data",
    which the checkpoint answers) is no difference."""
    old, new = flatten(recorded), flatten(current)
    return [
        (key, old[key], new[key])
        for key in sorted(old.keys() & new.keys())
        if role_of(key) != INVOCATION and old[key] != new[key] and not (key == "model.num_classes" and new[key] is None)
    ]


def run_identity_differences(recorded: dict, current: dict) -> list[str]:
    """Keys that make the checkpoint's run another run than this one (all but the resumable changes). batch_size is
    not one where both set the same total_batch_size: it then only says how many images one pass takes."""
    keys = [key for key, _, _ in setting_differences(recorded, current) if not resumable_change(key)]
    total = recorded.get("total_batch_size")
    if "batch_size" in keys and total is not None and total == current.get("total_batch_size"):
        keys.remove("batch_size")
    return keys


def find_resume_checkpoint(resume: str | None, *, output_dir: Path, search_root: Path, config: dict) -> Path | None:
    """The checkpoint ``resume`` names: None for None/empty, a path's file or its run directory's checkpoint.pth (it
    must exist), or resume=auto's (the module docstring; ``config``: this run's plain_config), None if there is none."""
    if not resume:
        return None
    if resume != "auto":
        path = named_checkpoint(resume)
        if not path.is_file():
            raise CheckpointError(f"resume={resume}: no checkpoint file at {path}")
        return path
    own = Path(output_dir) / LATEST
    if own.is_file():
        log.warning("resume=auto: continuing this run directory's checkpoint %s", own)
        return own
    others = []
    for path in sorted(Path(search_root).glob(f"*/*/{LATEST}"), key=lambda p: p.stat().st_mtime, reverse=True):
        if path.resolve() == own.resolve():
            continue
        recorded = read_recorded_config(path)
        if recorded is not None:
            recorded = upgrade_recorded_config(recorded)
        if recorded is None:
            log.warning("resume=auto: skipping %s, which cannot be read as a checkpoint of this trainer", path)
            continue
        differences = run_identity_differences(recorded, config)
        if not differences:
            written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
            log.warning(
                "resume=auto: continuing %s (written %s), the newest checkpoint under %s of a run with "
                "this run's settings; pass resume=null to start afresh",
                path,
                written,
                search_root,
            )
            return path
        others.append(f"{path} ({', '.join(differences[:3])} {'differs' if len(differences) == 1 else 'differ'})")
    if others:
        log.warning(
            "resume=auto: starting from scratch; the %d checkpoints under %s are of other runs, e.g. %s",
            len(others),
            search_root,
            others[0],
        )
    else:
        log.info("resume=auto: no checkpoint found, starting from scratch")
    return None


def load_resumed_checkpoint(path: str | os.PathLike) -> dict:
    """The checkpoint a run resumes, read once: its training state checked, its recorded config in this version's
    layout (upgrade_recorded_config) under "config"."""
    ckpt = load_checkpoint(path)
    check_training_state(ckpt, path=path)
    ckpt["config"] = upgrade_recorded_config(ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {})
    return ckpt


def config_for_resume(cfg: DictConfig, ckpt: dict, *, path: str | os.PathLike, report: bool = True) -> DictConfig:
    """The config a run resumed from ``ckpt`` (load_resumed_checkpoint's) uses: the checkpoint's model, everything
    else from ``cfg``; ``report`` (rank 0) logs the settings that differ, each with the value used. Raises ValueError
    when the checkpoint has already done what the schedule asks, so a resumed run never starts only to stop."""
    recorded = ckpt["config"]
    effective = copy.deepcopy(cfg)
    kept = {key: value for key, value in (recorded.get("model") or {}).items() if _kept_from_checkpoint(f"model.{key}")}
    put_recorded_model(effective.model, kept, path=path)
    # The checkpoint's weights replace the backbone's: nothing to fetch (offline, a download would only fail).
    effective.model.pretrained = "none"
    if report:
        lines = []
        for key, old, new in setting_differences(recorded, plain_config(cfg)):
            if _kept_from_checkpoint(key):
                lines.append(
                    f"{key}: {old!r} kept from the checkpoint, not {new!r} (a resumed model keeps its "
                    "architecture, classes and loss; start a new run to change them)"
                )
            else:
                lines.append(f"{key}: {new!r} from the command line, applied (the checkpoint had {old!r})")
        if lines:
            log.warning("resuming %s with settings that differ from the checkpoint's:\n  %s", path, "\n  ".join(lines))
    if ckpt.get("pending_evaluation"):  # stopped during an evaluation: the resume runs it, whatever is left
        return effective
    if ckpt["epoch"] >= effective.epochs:
        raise ValueError(
            f"resume: checkpoint {path} has completed {ckpt['epoch']} epochs and epochs="
            f"{effective.epochs}: nothing is left to train (raise epochs to train on; evaluate it "
            f"with eval_only=true checkpoint={path})"
        )
    if effective.max_steps is not None and ckpt["step"] >= effective.max_steps:
        raise ValueError(
            f"resume: checkpoint {path} is at step {ckpt['step']} and max_steps={effective.max_steps}: "
            "nothing is left to train (raise max_steps, or set it to null)"
        )
    return effective


def _state_laid_out_as_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Per-parameter state (AdamW's moments) in its parameter's memory layout. A checkpoint keeps the layout of
    the run that wrote it (a GPU run's backbone is channels_last, a CPU run's is not), and the fused optimizer
    pairs a parameter's elements with its state's by position in memory."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape and value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def restore_training_state(
    ckpt: dict,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler,
    scaler,
    cfg_optim,
    path: str | os.PathLike,
) -> None:
    """Load weights, optimizer, scheduler and scaler from ``ckpt`` into ``model`` (unwrapped); errors name the file.
    A changed schedule (SCHEDULE_KEYS) is then applied; an unchanged one leaves the state exactly as saved, so the
    resumed run computes what an uninterrupted one would."""
    load_model_weights(model, ckpt, path=path)
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
        _state_laid_out_as_parameters(optimizer)
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
        scaler.load_state_dict(ckpt["grad_scaler"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"checkpoint {path}: its optimizer or scheduler state does not fit this run's "
            f"parameter groups ({error}); was it written by another version of the model "
            "or with other optim.lr_backbone_names / lr_linear_proj_names?"
        ) from error
    recorded = (ckpt.get("config") or {}).get("optim")
    if isinstance(recorded, dict) and any(recorded.get(k) != cfg_optim[k] for k in SCHEDULE_KEYS):
        apply_schedule(optimizer, lr_scheduler, cfg_optim)


def checkpoint_step_images(ckpt: dict) -> int | None:
    """The images of one optimizer step of the run that wrote ``ckpt``: its ``step_images``, else (an older version)
    its total_batch_size, else its batch_size (one process's: the processes were not counted), else None."""
    if ckpt.get("step_images"):
        return int(ckpt["step_images"])
    recorded = ckpt.get("config") if isinstance(ckpt.get("config"), dict) else {}
    value = recorded.get("total_batch_size") or recorded.get("batch_size")
    return int(value) if value else None


def position_in_this_run(
    position: Position, *, steps_per_epoch: int, step_images: int, checkpoint_step_images: int | None
) -> tuple[Position, str | None]:
    """A resumed checkpoint's ``position`` counted in this run's steps (epochs done x steps per epoch + steps done of
    the epoch in progress, which the plan and the progress line count on), and what changed (None: nothing). When
    the checkpoint's steps took other images than this run's, the epoch in progress goes on after the images it had
    trained, in whole steps of this run (a part step's images are trained again)."""
    old_images = checkpoint_step_images or step_images
    steps_in_epoch = position.steps_in_epoch
    if old_images != step_images:
        steps_in_epoch = min(steps_per_epoch, position.steps_in_epoch * old_images // step_images)
    step = position.epoch * steps_per_epoch + steps_in_epoch
    if (step, steps_in_epoch) == (position.step, position.steps_in_epoch):
        return position, None
    if old_images != step_images:
        why = (
            f"the checkpoint's optimizer steps took {old_images} images and this run's take {step_images}, so "
            f"steps are counted in this run's: its {position.steps_in_epoch} steps of the epoch in progress "
            f"({position.steps_in_epoch * old_images} images) count as {steps_in_epoch} of {step_images} images, "
            f"and"
        )
    else:
        why = f"this run has {steps_per_epoch} steps per epoch, so"
    note = f"{why} its step {position.step} is step {step} here (TensorBoard's curves go on from step {step})"
    return dataclasses.replace(position, step=step, steps_in_epoch=steps_in_epoch), note


def apply_schedule(optimizer: torch.optim.Optimizer, lr_scheduler, cfg_optim) -> None:
    """Give a restored optimizer and StepLR the schedule of ``cfg_optim`` at the epoch they have reached, as if the
    run had had it from the start: each group's lr becomes its base lr * lr_gamma ** (epochs done // lr_drop)."""
    base = group_base_lrs(cfg_optim)
    lr_scheduler.step_size, lr_scheduler.gamma = cfg_optim.lr_drop, cfg_optim.lr_gamma
    drops = lr_scheduler.last_epoch // lr_scheduler.step_size
    for i, group in enumerate(optimizer.param_groups):
        group_base = base[group["name"]]
        group["initial_lr"] = lr_scheduler.base_lrs[i] = group_base
        group["lr"] = group_base * cfg_optim.lr_gamma**drops
        group["weight_decay"] = cfg_optim.weight_decay
    lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def explained_failure(error: BaseException, output_dir: str | os.PathLike) -> BaseException | None:
    """A training run's failure in the user's words where the data or the losses caused it (a damaged image, a dead
    loader worker, a non-finite loss), with what the run keeps and where to go on from; None for any other error.
    Called once the run's hooks have closed, so that no checkpoint is being written."""
    latest = Path(output_dir) / LATEST
    if isinstance(error, NonFiniteLossError):
        kept = (
            f"the last good checkpoint, {latest}, is kept (resume={latest})"
            if latest.exists()
            else "no checkpoint had been written yet"
        )
        return NonFiniteLossError(f"{error}: {kept}. Try a lower optim.lr, amp=none, or check the data")
    if isinstance(error, ImageReadError):  # a damaged image met while training
        fix = "fix or remove the file (and its annotations)"
        hint = (
            f"The run's last checkpoint is {latest}: {fix}, then continue with resume={latest}"
            if latest.is_file()
            else f"No checkpoint of this run has been written yet: {fix} and start again"
        )
        return ImageReadError(f"{worker_error_message(error)}\n{hint}")
    if is_worker_death(error):
        hint = (
            f"The run's last checkpoint is {latest}: continue with resume={latest}"
            if latest.is_file()
            else "No checkpoint of this run had been written yet: start it again"
        )
        return LoaderWorkerDied(
            f"a data loader worker process died ({worker_error_message(error)}): it was killed, or "
            f"ran out of memory (fewer num_workers use less)\n{hint}"
        )
    return None
