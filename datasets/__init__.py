"""COCO-format detection data: loading, augmentation, the synthetic set and COCO evaluation."""

from .coco import CocoDetection, EpochSampler, build_data_loader, build_dataset, coco2017_paths, collate_fn
from .evaluation import CocoEvaluator
from .synthetic import ensure_synthetic_dataset
from .transforms import make_coco_transforms

__all__ = [
    "CocoDetection",
    "CocoEvaluator",
    "EpochSampler",
    "build_data_loader",
    "build_dataset",
    "coco2017_paths",
    "collate_fn",
    "ensure_synthetic_dataset",
    "make_coco_transforms",
]
