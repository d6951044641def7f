"""The model config schema (configs/model/*.yaml): types, allowed values and the rules between keys.

``ModelConfig`` is registered in Hydra's ConfigStore (engine/config/registry.py), so a composed config is typed:
``model.nheads=abc`` or ``model.msda=cuda`` fail at composition with the key in the message. The rules
OmegaConf cannot express (ranges, divisibility, two_stage needing box refinement) live in the
``__post_init__`` methods below, the one place that build_deformable_detr and build_criterion rely on;
they run whenever a config becomes a ModelConfig (``read_model_config``, ``OmegaConf.to_object``).

Key names are the original's hyperparameter names and are the same in every layer (nheads, msda, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

import msda
from models.backbone import RESNET_CHANNELS
from models.one_to_many import OneToMany
from models.position_encoding import POSITION_EMBEDDINGS

# Enumerations built from the lists the constructors check, so the two never disagree. StrEnum: a member
# equals its string ("pytorch"), so code and checkpoints holding plain strings keep working.
Msda = StrEnum("Msda", {name: name for name in msda.IMPLS})
BackboneName = StrEnum("BackboneName", {name: name for name in RESNET_CHANNELS})
PositionEmbeddingName = StrEnum("PositionEmbeddingName", {name: name for name in POSITION_EMBEDDINGS})

_COST_AND_LOSS_WEIGHTS = (
    "set_cost_class",
    "set_cost_bbox",
    "set_cost_giou",
    "cls_loss_coef",
    "bbox_loss_coef",
    "giou_loss_coef",
)
_POSITIVE_INTS = (
    "hidden_dim",
    "nheads",
    "enc_layers",
    "dim_feedforward",
    "num_feature_levels",
    "enc_n_points",
    "dec_n_points",
    "num_queries",
    "num_queries_one2many",
)


@dataclass
class CriterionConfig:
    """The model keys the loss side reads (build_criterion): classes, decoder outputs, matcher and loss."""

    num_classes: Optional[int] = MISSING  # null: the trainer takes it from the training annotations
    dec_layers: int = MISSING
    aux_loss: bool = MISSING
    two_stage: bool = MISSING
    set_cost_class: float = MISSING
    set_cost_bbox: float = MISSING
    set_cost_giou: float = MISSING
    cls_loss_coef: float = MISSING
    bbox_loss_coef: float = MISSING
    giou_loss_coef: float = MISSING
    focal_alpha: float = MISSING
    # One-to-many supervision while training (models/one_to_many.py): none | hybrid (H-DETR's extra queries, matched
    # to each image's targets repeated k_one2many times) | mixed (MS-DETR: the model's own queries, up to k_one2many
    # per target), its losses weighted by lambda_one2many (cls_loss_coef_one2many: the classification's weight, null:
    # cls_loss_coef). Defaults here as well as in the yaml, so that a config recorded before the options still reads.
    one_to_many: OneToMany = OneToMany.none
    k_one2many: int = 6
    lambda_one2many: float = 1.0
    cls_loss_coef_one2many: Optional[float] = None

    def __post_init__(self) -> None:
        problems = []
        if self.num_classes is not None and self.num_classes < 1:
            problems.append(
                f"model.num_classes must be an integer >= 1 or null (from the data), got {self.num_classes!r}"
            )
        if self.dec_layers < 1:
            problems.append(f"model.dec_layers must be an integer >= 1, got {self.dec_layers!r}")
        problems += [
            f"model.{key} must be a finite number >= 0, got {getattr(self, key)!r}"
            for key in _COST_AND_LOSS_WEIGHTS
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0)
        ]
        if self.set_cost_class == self.set_cost_bbox == self.set_cost_giou == 0:
            problems.append(
                "model.set_cost_class, set_cost_bbox and set_cost_giou are all 0: the matcher has nothing to match on"
            )
        if not (0 <= self.focal_alpha <= 1 or self.focal_alpha == -1):
            problems.append(
                f"model.focal_alpha must be in [0, 1] (or -1: no class weighting), got {self.focal_alpha!r}"
            )
        if self.k_one2many < 1:
            problems.append(
                f"model.k_one2many must be an integer >= 1 (one-to-many supervision's pairs per target), got "
                f"{self.k_one2many!r}"
            )
        for key in ("lambda_one2many", "cls_loss_coef_one2many"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value >= 0):
                problems.append(f"model.{key} must be a finite number >= 0, got {value!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class ModelConfig(CriterionConfig):
    """configs/model/deformable_detr.yaml, key for key (the comments there say what each does)."""

    # backbone
    backbone: BackboneName = MISSING
    dilation: bool = MISSING
    position_embedding: PositionEmbeddingName = MISSING
    # How to run, not what is trained (metadata read by engine/config/train_schema.py: a resumed run or an evaluated
    # checkpoint takes these from the command line).
    pretrained: Optional[str] = field(default="none", metadata={"role": "how_to_run"})  # none | imagenet | path
    train_backbone: bool = True
    # A checkpoint whose weights start a new run (engine/checkpoint/init_from.py); a resumed run has its own.
    init_from: Optional[str] = field(default=None, metadata={"role": "how_to_run"})
    # transformer
    hidden_dim: int = MISSING
    nheads: int = MISSING
    enc_layers: int = MISSING
    dim_feedforward: int = MISSING
    dropout: float = MISSING
    num_feature_levels: int = MISSING
    enc_n_points: int = MISSING
    dec_n_points: int = MISSING
    num_queries: int = MISSING
    num_queries_one2many: int = 1500  # hybrid one-to-many supervision's extra queries (model.one_to_many=hybrid)
    with_box_refine: bool = MISSING
    # Deformable-DETR++'s training changes (H-DETR's "tricks", after DINO), off in the published recipes:
    mixed_selection: bool = False  # two-stage: positions from the top proposals, content from a learned embedding
    look_forward_twice: bool = False  # box refinement: a layer's box loss also trains the layer before's box
    cross_attention_first: bool = False  # each decoder layer: cross-attention, self-attention, FFN (MS-DETR's order)
    msda: Msda = field(default=Msda.auto, metadata={"role": "how_to_run"})

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = [
            f"model.{key} must be an integer >= 1, got {getattr(self, key)!r}"
            for key in _POSITIVE_INTS
            if getattr(self, key) < 1
        ]
        if not 0 <= self.dropout < 1:
            problems.append(f"model.dropout must be a number in [0, 1), got {self.dropout!r}")
        if problems:
            raise ValueError("; ".join(problems))
        # Rules between keys, after the single-key ones so that their messages can trust the values.
        if self.hidden_dim % self.nheads:
            raise ValueError(
                f"model.hidden_dim must be divisible by model.nheads, got hidden_dim={self.hidden_dim}, "
                f"nheads={self.nheads}"
            )
        if self.hidden_dim % 32:
            raise ValueError(
                f"model.hidden_dim must be a multiple of 32 (GroupNorm(32) in input_proj), got {self.hidden_dim}"
            )
        if self.num_feature_levels == 2:
            raise ValueError(
                "model.num_feature_levels must be 1 (layer4 only) or >= 3 (layer2-4 plus extra stride-2 levels), got 2"
            )
        if self.mixed_selection and not self.two_stage:
            raise ValueError(
                "model.mixed_selection=true needs model.two_stage=true (its query positions are the top proposals')"
            )
        if self.look_forward_twice and not self.with_box_refine:
            raise ValueError(
                "model.look_forward_twice=true needs model.with_box_refine=true (it passes the refined boxes' "
                "gradient one layer back)"
            )
        if self.two_stage and not self.with_box_refine:
            raise ValueError(
                "model.two_stage=true needs model.with_box_refine=true (as in the original, whose "
                "two-stage decoder uses the per-layer box heads)"
            )
        if self.dilation and self.backbone in ("resnet18", "resnet34"):
            raise ValueError(
                f"model.dilation=true needs a bottleneck ResNet (resnet50/101), got model.backbone={self.backbone}"
            )
        if self.pretrained is None:
            self.pretrained = "none"


MODEL_KEYS = frozenset(f.name for f in fields(ModelConfig))


def _read(cfg: Any, schema: type, keys: frozenset[str] | None = None):
    if isinstance(cfg, schema):
        return cfg  # checked when it was made (a config's one check, engine/config/registry.py)
    if not isinstance(cfg, (dict, DictConfig)):
        raise TypeError(f"model config must be a mapping (configs/model/*.yaml), got {type(cfg).__name__}")
    if keys is not None:
        cfg = {k: cfg[k] for k in cfg if k in keys}
    # OmegaConf converts and checks every value against the schema: an unknown key, a wrong type, a value
    # outside an enumeration or a missing key is an error naming the key (under "model.", as when composed).
    # __post_init__ adds the rules.
    typed = OmegaConf.merge({"model": OmegaConf.structured(schema)}, {"model": cfg})
    return OmegaConf.to_object(typed.model)


def read_model_config(cfg: Any) -> ModelConfig:
    """A model config (composed DictConfig or plain mapping) checked into a :class:`ModelConfig`; a ModelConfig
    as it is."""
    return _read(cfg, ModelConfig)


def read_criterion_config(cfg: Any) -> CriterionConfig:
    """The loss-side keys of a model config (the others are ignored), checked into a CriterionConfig."""
    return _read(cfg, CriterionConfig, frozenset(f.name for f in fields(CriterionConfig)))


def resolved_num_classes(c: CriterionConfig) -> int:
    """``c.num_classes``, which must have been set by now (null means "take it from the data")."""
    if c.num_classes is None:
        raise ValueError(
            "model.num_classes is null (take it from the data): the trainer sets it from the training "
            "annotations before building the model; when building one directly, set it"
        )
    return c.num_classes
