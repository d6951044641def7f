"""A detector from a checkpoint, ours or an official one: the one path eval_only (``checkpoint_model``), predict.py
and export.py (``load_trained_model``, which adds the recorded class names and inference size) take."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from datasets.coco_categories import COCO_CATEGORY_NAMES
from datasets.transforms import COCO_MAX_SIZE, COCO_VAL_SIZE
from engine.config.run_files import named_checkpoint
from models import build_model
from models.model_config import MODEL_KEYS

from .contents import EMA_KEY, load_model_weights, model_config_for_checkpoint, model_state_dict
from .io import load_checkpoint
from .num_classes import classes_in_weights

log = logging.getLogger(__name__)


@dataclass
class CheckpointModel:
    """What a checkpoint says its detector is: ``path``, its contents ``ckpt``, the ``model_config`` to build it with
    (a plain dict), and the ``weights`` ``load_into`` loads: "ema" (the model EMA's where it holds one) or "raw"."""

    path: Path
    ckpt: dict
    model_config: dict
    weights: str = "ema"

    @property
    def uses_ema(self) -> bool:
        return self.weights == "ema" and isinstance(self.ckpt.get(EMA_KEY), dict)

    @property
    def step(self) -> int:
        """The training step the checkpoint was saved at (0 where it does not record one)."""
        return int(self.ckpt.get("step", 0) or 0)

    def load_into(self, model: torch.nn.Module) -> None:
        """The checkpoint's weights (``weights``) into ``model`` (built from ``model_config``), strictly."""
        ckpt = self.ckpt
        if self.uses_ema:
            log.info("the model EMA's weights of %s (checkpoint_weights=raw for its trained ones)", self.path)
            ckpt = {"model": {**model_state_dict(ckpt), **ckpt[EMA_KEY]["model"]}}
        load_model_weights(model, ckpt, path=self.path)


def checkpoint_model(
    checkpoint: str | Path, cfg_model, *, msda: str | None = None, weights: str = "ema"
) -> CheckpointModel:
    """The detector ``checkpoint`` (a file or a run directory) holds: ``cfg_model`` (DictConfig or dict) with what the
    checkpoint records put in; ``msda``: the attention to run instead of the config's; ``weights``: "ema" or "raw"."""
    path = named_checkpoint(checkpoint)
    ckpt = load_checkpoint(path)
    plain = OmegaConf.to_container(cfg_model, resolve=True) if OmegaConf.is_config(cfg_model) else dict(cfg_model)
    # Inference uses the one-to-one queries only: build the model without hybrid matching (load_model_weights drops
    # the one-to-many queries), so that predict and export run that graph.
    model_config = model_config_for_checkpoint(plain, ckpt, path=path, keys=MODEL_KEYS - {"hybrid_matching"})
    model_config["hybrid_matching"] = False
    model_config["num_classes"] = classes_in_weights(ckpt["model"]) or model_config["num_classes"]
    if msda is not None:
        model_config["msda"] = msda
    return CheckpointModel(path=path, ckpt=ckpt, model_config=model_config, weights=str(weights))


@dataclass
class TrainedModel:
    """A loaded DeformableDETR in eval mode, its PostProcess (outputs -> per image {"scores", "labels", "boxes" xyxy
    in the given sizes}), category names by id, and the resize (``val_size`` short side, ``max_size`` long side) the
    checkpoint's run evaluated at."""

    model: torch.nn.Module
    postprocess: torch.nn.Module
    model_config: dict
    categories: dict[int, str]
    val_size: int
    max_size: int
    checkpoint: Path
    step: int


def load_trained_model(
    checkpoint: str | Path,
    cfg_model,
    *,
    device: torch.device,
    msda: str | None = None,
    categories: dict[int, str] | None = None,
    weights: str = "ema",
) -> TrainedModel:
    """``checkpoint_model``'s detector built, loaded and on ``device`` in eval mode; ``categories``: names to use
    instead of the checkpoint's (e.g. from an annotation file)."""
    source = checkpoint_model(checkpoint, cfg_model, msda=msda, weights=weights)
    model, _, postprocess = build_model(source.model_config)
    source.load_into(model)
    model.to(device).eval()
    # The run's resize as its config records it, else COCO's.
    dataset = source.ckpt["config"].get("dataset") if isinstance(source.ckpt.get("config"), dict) else None
    val_size, max_size = COCO_VAL_SIZE, COCO_MAX_SIZE
    if isinstance(dataset, dict) and dataset.get("val_size") and dataset.get("max_size"):
        val_size, max_size = int(dataset["val_size"]), int(dataset["max_size"])
    if categories is None:
        categories = recorded_categories(source.ckpt, source.model_config["num_classes"])
    return TrainedModel(
        model=model,
        postprocess=postprocess.to(device),
        model_config=source.model_config,
        categories=categories,
        val_size=val_size,
        max_size=max_size,
        checkpoint=source.path,
        step=source.step,
    )


def recorded_categories(ckpt: dict, num_classes: int) -> dict[int, str]:
    """category id -> name as ``ckpt`` records them, else COCO's for a class head of 91 rows, else none."""
    recorded = ckpt.get("categories")
    if isinstance(recorded, dict) and recorded:
        return {int(k): str(v) for k, v in recorded.items()}
    if num_classes == max(COCO_CATEGORY_NAMES) + 1:
        return dict(COCO_CATEGORY_NAMES)
    log.info("the checkpoint names no classes: they are shown as 'class N' (annotations=FILE.json names them)")
    return {}
