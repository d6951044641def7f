"""A detector from a checkpoint, ours or an official one, the one way eval_only, predict.py and export.py take:
``checkpoint_model`` reads the file once and says what it holds (the model config, the weights to load),
``build_trained_model`` builds that model on its device (compiled where asked) with the weights, the recorded class
names and the inference size."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from datasets.coco_categories import COCO_CATEGORY_NAMES
from datasets.transforms import COCO_MAX_SIZE, COCO_VAL_SIZE
from engine.compile.plan import CompilePlan
from engine.compile.run_model import build_run_model
from engine.config.run_files import named_checkpoint
from models.model_config import MODEL_KEYS

from .contents import averaged_weights, load_model_weights, model_config_for_checkpoint, model_state_dict
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
        return self.weights == "ema" and averaged_weights(self.ckpt) is not None

    @property
    def loaded_weights(self) -> str:
        """Whose weights ``load_into`` loads: "ema" or "raw" (as eval json and the ONNX metadata name them)."""
        return "ema" if self.uses_ema else "raw"

    @property
    def recorded_config(self) -> dict | None:
        """The config the checkpoint's run recorded (ours), or None."""
        config = self.ckpt.get("config")
        return config if isinstance(config, dict) else None

    @property
    def step(self) -> int:
        """The training step the checkpoint was saved at (0 where it does not record one)."""
        return int(self.ckpt.get("step", 0) or 0)

    def load_into(self, model: torch.nn.Module) -> None:
        """The checkpoint's weights (``weights``) into ``model`` (built from ``model_config``), strictly."""
        ckpt = self.ckpt
        if self.uses_ema:
            log.info("the model EMA's weights of %s (checkpoint_weights=raw for its trained ones)", self.path)
            ckpt = {"model": {**model_state_dict(ckpt), **averaged_weights(ckpt)}}
        load_model_weights(model, ckpt, path=self.path)


def checkpoint_model(
    checkpoint: str | Path, cfg_model, *, msda: str | None = None, weights: str = "ema"
) -> CheckpointModel:
    """The detector ``checkpoint`` (a file or a run directory) holds: ``cfg_model`` (DictConfig or dict) with what the
    checkpoint records put in; ``msda``: the attention to run instead of the config's; ``weights``: "ema" or "raw"."""
    path = named_checkpoint(checkpoint)
    ckpt = load_checkpoint(path)
    plain = OmegaConf.to_container(cfg_model, resolve=True) if OmegaConf.is_config(cfg_model) else dict(cfg_model)
    # Inference runs the one-to-one queries alone: the model without one-to-many supervision, so that predict and
    # export run that graph (load_model_weights leaves out the training-only tensors).
    model_config = model_config_for_checkpoint(plain, ckpt, path=path, keys=MODEL_KEYS - {"one_to_many"})
    model_config["one_to_many"] = "none"
    model_config["num_classes"] = classes_in_weights(ckpt["model"]) or model_config["num_classes"]
    if msda is not None:
        model_config["msda"] = msda
    return CheckpointModel(path=path, ckpt=ckpt, model_config=model_config, weights=str(weights))


@dataclass
class TrainedModel:
    """A loaded DeformableDETR in eval mode on its device, its PostProcess (outputs -> per image {"scores", "labels",
    "boxes" xyxy in the given sizes}), category names by id, the resize (``val_size`` short side, ``max_size`` long
    side) the checkpoint's run evaluated at, and how it was compiled (None: eager)."""

    model: torch.nn.Module
    postprocess: torch.nn.Module
    model_config: dict
    categories: dict[int, str]
    val_size: int
    max_size: int
    source: CheckpointModel
    compile_plan: CompilePlan | None = None

    @property
    def checkpoint(self) -> Path:
        return self.source.path

    @property
    def step(self) -> int:
        return self.source.step


def build_trained_model(
    source: CheckpointModel,
    *,
    device: torch.device,
    model_config=None,
    categories: dict[int, str] | None = None,
    cfg_compile=None,
    evaluation_batches: int = 0,
) -> TrainedModel:
    """``source``'s detector built on ``device`` with its weights, in eval mode. ``model_config``: a checked
    ModelConfig of source.model_config (None: checked as it is built); ``categories``: names to use instead of the
    checkpoint's (e.g. from an annotation file); ``cfg_compile``, ``evaluation_batches``: compile the evaluation
    graph as a run's ``compile`` group says (engine/compile/run_model.py; None: eager)."""
    built = build_run_model(
        source.model_config if model_config is None else model_config,
        cfg_compile,
        device=device,
        training=False,
        load_weights=source.load_into,
        evaluation_batches=evaluation_batches,
    )
    built.model.eval()
    # The run's resize as its config records it, else COCO's.
    dataset = (source.recorded_config or {}).get("dataset")
    val_size, max_size = COCO_VAL_SIZE, COCO_MAX_SIZE
    if isinstance(dataset, dict) and dataset.get("val_size") and dataset.get("max_size"):
        val_size, max_size = int(dataset["val_size"]), int(dataset["max_size"])
    if categories is None:
        categories = recorded_categories(source.ckpt, source.model_config["num_classes"])
    return TrainedModel(
        model=built.model,
        postprocess=built.postprocess.to(device),
        model_config=source.model_config,
        categories=categories,
        val_size=val_size,
        max_size=max_size,
        source=source,
        compile_plan=built.compile_plan,
    )


def load_trained_model(
    checkpoint: str | Path,
    cfg_model,
    *,
    device: torch.device,
    msda: str | None = None,
    categories: dict[int, str] | None = None,
    weights: str = "ema",
) -> TrainedModel:
    """``checkpoint_model`` then ``build_trained_model``, eager: predict.py's and export.py's model."""
    source = checkpoint_model(checkpoint, cfg_model, msda=msda, weights=weights)
    return build_trained_model(source, device=device, categories=categories)


def recorded_categories(ckpt: dict, num_classes: int) -> dict[int, str]:
    """category id -> name as ``ckpt`` records them, else COCO's for a class head of 91 rows, else none."""
    recorded = ckpt.get("categories")
    if isinstance(recorded, dict) and recorded:
        return {int(k): str(v) for k, v in recorded.items()}
    if num_classes == max(COCO_CATEGORY_NAMES) + 1:
        return dict(COCO_CATEGORY_NAMES)
    log.info("the checkpoint names no classes: they are shown as 'class N' (annotations=FILE.json names them)")
    return {}
