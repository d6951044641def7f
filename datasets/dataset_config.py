"""The dataset config schemas (configs/dataset/*.yaml): one per kind of set, sharing the transform keys.

Each schema is registered in Hydra's ConfigStore (engine/config/registry.py) and pulled in by its yaml file, so a
composed ``dataset`` is typed: ``dataset.num_train=abc`` fails at composition, and so does a key the
chosen set does not have (``dataset=coco dataset.num_train=10``), each with the key in the message. The
rules OmegaConf cannot express (ranges) are the ``__post_init__`` methods below.

Defaults are the published COCO transform values, so a plain mapping such as
``{"name": "coco", "root": "/data/coco"}`` is a complete config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from .synthetic import CLASSES, DENSITIES
from .transforms import (
    COCO_CROP_MAX_SIZE,
    COCO_CROP_MIN_SIZE,
    COCO_CROP_SCALES,
    COCO_MAX_SIZE,
    COCO_TRAIN_SCALES,
    COCO_VAL_SIZE,
)


class DatasetName(StrEnum):
    coco = "coco"  # COCO 2017 layout under root
    synthetic = "synthetic"  # the built-in set, written under root on first use
    custom = "custom"  # any COCO-format set: explicit image directories and annotation files


# How crowded the synthetic set is (datasets/synthetic.py): sparse, the quick start's 1-5 objects of 6 classes; coco,
# 2-20 objects of 24 classes, many small and overlapping.
SyntheticDensity = StrEnum("SyntheticDensity", {name: name for name in DENSITIES})


def _positive(cfg, keys: tuple[str, ...]) -> list[str]:
    return [
        f"dataset.{key} must be an integer >= 1, got {getattr(cfg, key)!r}" for key in keys if getattr(cfg, key) < 1
    ]


@dataclass
class DatasetConfig:
    """Keys every set has: its kind, up-front image checks, and the augmentation (datasets/transforms.py)."""

    name: DatasetName = MISSING
    # Validation images are always opened once before training; verify=true opens every training image too
    # (worth it for a new set; minutes for all of COCO, hence off there).
    verify: bool = field(default=False, metadata={"role": "how_to_run"})  # engine/config/train_schema.py: roles
    train_scales: list[int] = field(default_factory=lambda: list(COCO_TRAIN_SCALES))
    max_size: int = COCO_MAX_SIZE
    val_size: int = COCO_VAL_SIZE
    crop: bool = True
    crop_scales: list[int] = field(default_factory=lambda: list(COCO_CROP_SCALES))
    crop_min_size: int = COCO_CROP_MIN_SIZE
    crop_max_size: int = COCO_CROP_MAX_SIZE
    # Canonical batch sizes, training and evaluation together (datasets/size_buckets.py): images of similar
    # size after augmentation are batched together and padded to one of these. Each new size costs a compiled
    # model a compilation and an eager one a cuDNN plan. 0: batches of any images, padded to the largest.
    size_buckets: int = 8
    # Batch sides are multiples of this (the buckets' sides; without buckets, each batch's).
    pad_to_multiple: int = 1

    def __post_init__(self) -> None:
        problems = _positive(self, ("max_size", "val_size", "crop_min_size", "crop_max_size", "pad_to_multiple"))
        if self.size_buckets != 0 and self.size_buckets < 2:
            problems.append(
                f"dataset.size_buckets must be 0 (no buckets) or at least 2 (one size per orientation "
                f"for training and one for evaluation), got {self.size_buckets!r}"
            )
        kind = next(f.default for f in fields(self) if f.name == "name")  # the set this schema is for
        if kind is not MISSING and self.name != kind:
            problems.append(
                f"dataset.name is {self.name} in the {kind} dataset config: choose the set with "
                f"dataset={self.name}, not dataset.name={self.name}"
            )
        for key in ("train_scales", "crop_scales"):
            values = getattr(self, key)
            if not values or min(values) < 1:
                problems.append(f"dataset.{key} must be a non-empty list of sizes >= 1, got {values!r}")
        if self.crop_min_size > self.crop_max_size:
            problems.append(
                f"dataset.crop_min_size ({self.crop_min_size}) must not exceed dataset.crop_max_size "
                f"({self.crop_max_size})"
            )
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class CocoDatasetConfig(DatasetConfig):
    """COCO 2017: root/{train,val}2017/ and root/annotations/instances_{train,val}2017.json."""

    name: DatasetName = DatasetName.coco
    root: str = "data/coco"


@dataclass
class SyntheticDatasetConfig(DatasetConfig):
    """The built-in synthetic set (datasets/synthetic.py), in the COCO 2017 layout under root."""

    name: DatasetName = DatasetName.synthetic
    root: str = "data/synthetic"
    num_train: int = 256
    num_val: int = 64
    image_size: int = 128
    seed: int = 0
    num_categories: int = len(CLASSES)  # the first N classes of the density's (ids 1..N; coco: COCO's first N ids)
    density: SyntheticDensity = SyntheticDensity.sparse

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = _positive(self, ("num_train", "num_val"))
        classes = len(DENSITIES[self.density])
        if not 1 <= self.num_categories <= classes:
            problems.append(
                f"dataset.num_categories must be 1..{classes} at dataset.density={self.density}, "
                f"got {self.num_categories}"
            )
        if self.image_size < 16:
            problems.append(f"dataset.image_size must be at least 16 pixels, got {self.image_size}")
        if self.seed < 0:
            problems.append(f"dataset.seed must be >= 0, got {self.seed}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class CustomDatasetConfig(DatasetConfig):
    """Your own COCO-format set: an image directory and an annotation file per split (any category ids).

    The paths are checked when a split is built, so evaluating (eval_only) needs only the val_ ones.
    """

    name: DatasetName = DatasetName.custom
    train_images: Optional[str] = None
    train_annotations: Optional[str] = None
    val_images: Optional[str] = None
    val_annotations: Optional[str] = None


DATASET_SCHEMAS: dict[DatasetName, type[DatasetConfig]] = {
    DatasetName.coco: CocoDatasetConfig,
    DatasetName.synthetic: SyntheticDatasetConfig,
    DatasetName.custom: CustomDatasetConfig,
}


def read_dataset_config(cfg: Any) -> DatasetConfig:
    """A dataset config (composed DictConfig or plain mapping) checked into the schema its ``name`` selects.

    ``name`` defaults to coco. Unknown keys, wrong types and missing values are errors naming the key.
    """
    if not isinstance(cfg, (dict, DictConfig)):
        raise TypeError(f"dataset config must be a mapping (configs/dataset/*.yaml), got {type(cfg).__name__}")
    name = cfg.get("name") or DatasetName.coco
    if name not in DATASET_SCHEMAS:
        raise ValueError(f"dataset.name must be one of {', '.join(DATASET_SCHEMAS)}, got {name!r}")
    typed = OmegaConf.merge({"dataset": OmegaConf.structured(DATASET_SCHEMAS[DatasetName(name)])}, {"dataset": cfg})
    return OmegaConf.to_object(typed.dataset)
