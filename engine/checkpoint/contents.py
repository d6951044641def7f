"""What a checkpoint holds: the training state a resume needs, the model config it records (ours in
``config['model']``, an official one in ``args``), its weights; engine/checkpoint/io.py lists the keys."""

from __future__ import annotations

import argparse
import enum
import logging
import os
from collections.abc import Collection

import torch
from omegaconf.errors import OmegaConfBaseException

from engine.config.run_files import named_checkpoint
from engine.config.train_schema import HOW_TO_RUN, role_of, upgrade_recorded_config
from engine.errors import CheckpointError

log = logging.getLogger(__name__)

TRAINING_STATE = ("optimizer", "lr_scheduler", "grad_scaler", "epoch", "steps_in_epoch", "step", "rng")
# A checkpoint's model EMA (engine/train/hooks/ema.py): {"model": floating tensors by name, "updates": steps averaged}.
EMA_KEY = "ema"


def averaged_weights(ckpt: dict) -> dict | None:
    """The model EMA's weights a checkpoint holds (floating tensors by name), or None."""
    share = ckpt.get(EMA_KEY)
    return share["model"] if isinstance(share, dict) and isinstance(share.get("model"), dict) else None


def check_training_state(ckpt: dict, *, path: str | os.PathLike) -> None:
    """Resuming needs the whole training state, which only this trainer's checkpoints hold."""
    missing = [k for k in TRAINING_STATE if k not in ckpt]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} cannot be resumed: it has no {', '.join(missing)} (resume needs a checkpoint.pth "
            f"written by this trainer; an official checkpoint can be evaluated with eval_only=true checkpoint=PATH)"
        )


def recorded_model_config(ckpt: dict) -> dict:
    """The model hyperparameters a checkpoint records: our 'config'['model'] (in this version's layout), or the
    official 'args'."""
    config = ckpt.get("config")
    if isinstance(config, dict) and isinstance(config.get("model"), dict):
        return dict(upgrade_recorded_config({"model": config["model"]})["model"])
    args = ckpt.get("args")
    args = vars(args) if isinstance(args, argparse.Namespace) else args
    return dict(args) if isinstance(args, dict) else {}


def shown(value) -> str:
    """A config value for a log line: an enum member (a typed config's choice) shown as its value, as a string is."""
    return repr(value.value if isinstance(value, enum.Enum) else value)


def model_config_for_checkpoint(
    cfg_model: dict, ckpt: dict, *, path: str | os.PathLike, keys: Collection[str] | None = None
) -> dict:
    """``cfg_model`` with the values the checkpoint records (our config or the official args; only ``keys`` when
    given) put in, except the how-to-run ones: the weights fix the architecture. ``pretrained`` becomes none, as the
    checkpoint replaces the ImageNet backbone weights."""
    merged = dict(cfg_model)
    for key, value in recorded_model_config(ckpt).items():
        if keys is not None and key not in keys:
            continue
        if key in merged and role_of(f"model.{key}") != HOW_TO_RUN and merged[key] != value:
            log.info("model.%s=%s as recorded in %s (config said %s)", key, shown(value), path, shown(merged[key]))
            merged[key] = value
    if "pretrained" in merged:
        merged["pretrained"] = "none"
    return merged


def put_recorded_model(model_node, recorded: dict, *, path: str | os.PathLike) -> None:
    """The model settings a checkpoint records (``recorded``) into the typed config node ``model_node``, each
    checked like an override; CheckpointError naming the file and the key for a value this version refuses."""
    for key, value in recorded.items():
        try:
            model_node[key] = value
        except OmegaConfBaseException as error:
            raise CheckpointError(
                f"checkpoint {path} records model.{key}={value!r}, which this version does not accept "
                f"({str(error).splitlines()[0]})"
            ) from error


def model_state_dict(ckpt: dict) -> dict:
    """``ckpt['model']`` with the ``module.`` prefix of a DDP-wrapped save removed."""
    state = ckpt["model"]
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def load_model_weights(model: torch.nn.Module, ckpt: dict, *, path: str | os.PathLike) -> None:
    """Strictly load ``ckpt['model']``; CheckpointError naming the differing parameters and the likely settings.
    The parameters the model says training alone uses (``is_training_only``: one-to-many supervision's), which
    inference never uses, are the exception: left out where the model has none, kept at their initialization where
    the checkpoint has none (logged)."""
    state = model_state_dict(ckpt)
    own = model.state_dict()
    training_only = getattr(model, "is_training_only", lambda name: False)
    unused = sorted(k for k in state if training_only(k) and k not in own)
    if unused:
        state = {k: v for k, v in state.items() if k not in unused}
        log.info(
            "checkpoint %s holds %d tensors of one-to-many supervision's training (%s), which this model "
            "(model.one_to_many=none) has not: left out, as inference uses the one-to-one queries alone",
            path,
            len(unused),
            _names(unused),
        )
    fresh = sorted(k for k in own if training_only(k) and k not in state)
    reshaped = [
        f"{k} {tuple(v.shape)} in the checkpoint, {tuple(own[k].shape)} in the model"
        for k, v in state.items()
        if k in own and torch.is_tensor(v) and v.shape != own[k].shape
    ]
    if reshaped:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model: {len(reshaped)} parameters differ in shape (e.g. "
            f"{'; '.join(reshaped[:3])}). Check model.num_classes, model.hidden_dim, model.num_queries, "
            f"model.num_feature_levels and the other sizes against the checkpoint"
        )
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in fresh]
    problems = [
        f"{len(keys)} {kind} (e.g. {keys[:3]})"
        for kind, keys in (("missing", missing), ("unexpected", result.unexpected_keys))
        if keys
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model: parameters {'; '.join(problems)}. Check the variant "
            f"(model.with_box_refine, model.two_stage) and the model sizes against the checkpoint"
        )
    if fresh:
        log.info(
            "checkpoint %s has none of this model's %d tensors of one-to-many supervision's training (%s): they keep "
            "their initialization (inference does not use them)",
            path,
            len(fresh),
            _names(fresh),
        )


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def read_recorded_config(path: str | os.PathLike) -> dict | None:
    """The config a checkpoint of ours records, or None (unreadable, or not ours); memory-mapped: no tensor read."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            obj = torch.load(named_checkpoint(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # any unreadable file is simply not a candidate; its name is logged by the caller
        return None
    config = obj.get("config") if isinstance(obj, dict) else None
    return config if isinstance(config, dict) else None
