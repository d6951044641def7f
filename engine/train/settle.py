"""A run's config is settled, then checked once, then frozen.

Settling puts in the values that come from elsewhere than the command line: a resumed run's model is its
checkpoint's (engine/train/resume.py), a new run's variant is ``model.init_from``'s (whose weights come back as
InitFrom), an evaluated checkpoint's model is the one it records, and the classes come from the data where
model.num_classes is null. The whole config, model and criterion included, is then checked by one call
(engine/config/registry.py) and made read-only; the model is built from the typed config that check made.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from engine.checkpoint.contents import put_recorded_model
from engine.checkpoint.init_from import InitFrom, prepare_init_from
from engine.checkpoint.num_classes import resolve_num_classes
from engine.checkpoint.trained_model import CheckpointModel
from engine.config.registry import check_and_freeze, plain_config
from engine.config.train_schema import TrainConfig
from engine.runtime.distributed import DistContext, broadcast_object

from .resume import config_for_resume, find_resume_checkpoint, load_resumed_checkpoint
from .run_setup import build_datasets


@dataclass
class SettledRun:
    """A training run's config, settled, checked and frozen, and what settling it read."""

    cfg: DictConfig  # read-only
    checked: TrainConfig  # the typed config the one check built: the model is built from its ``model``
    data: dict  # "train" and "val" CocoDetection sets
    ckpt: dict | None  # the checkpoint the run resumes, if any
    resume_path: Path | None
    init: InitFrom  # model.init_from's weights (path None when it is not set)


def settle_training(cfg: DictConfig, ctx: DistContext, output_dir: Path) -> SettledRun:
    """The data read and checked, the checkpoint to resume found and read, model.init_from read; the config settled
    from them, checked and frozen (the module docstring)."""
    # The data first: it is checked before anything is trained, and may decide model.num_classes.
    data = build_datasets(cfg, ctx, ("train", "val"))
    resume_path, ckpt = None, None
    if ctx.is_main:  # rank 0 picks (resume=auto looks at file times), so every rank resumes from the same file
        resume_path = find_resume_checkpoint(
            cfg.resume, output_dir=output_dir, search_root=Path("outputs"), config=plain_config(cfg)
        )
    resume_path = broadcast_object(resume_path, ctx)
    if resume_path is not None:
        ckpt = load_resumed_checkpoint(resume_path)
        settled = config_for_resume(cfg, ckpt, path=resume_path, report=ctx.is_main)
        init = InitFrom()
    else:
        settled = copy.deepcopy(cfg)
        init = prepare_init_from(settled.model, weights=settled.checkpoint_weights)
    settled.model.num_classes = resolve_num_classes(
        settled.model.num_classes, data, resumed_from=str(resume_path) if ckpt is not None else None
    )
    checked = check_and_freeze(settled)
    return SettledRun(cfg=settled, checked=checked, data=data, ckpt=ckpt, resume_path=resume_path, init=init)


def settle_evaluation(cfg: DictConfig, source: CheckpointModel, val_set) -> tuple[DictConfig, TrainConfig]:
    """eval_only's config, settled with the model ``source`` (the evaluated checkpoint) records and the classes of its
    class head (checked against ``val_set``'s category ids), checked and frozen: (read-only config, typed config)."""
    settled = copy.deepcopy(cfg)
    put_recorded_model(settled.model, source.model_config, path=source.path)
    resolve_num_classes(source.model_config["num_classes"], {"val": val_set}, evaluated=str(source.path))
    return settled, check_and_freeze(settled)
