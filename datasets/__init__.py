"""COCO-format detection data: loading, checking, augmentation, the synthetic set and COCO evaluation."""

from .annotations import AnnotationFileError
from .coco import CocoDetection, EpochSampler, build_data_loader, build_dataset, coco2017_paths, collate_fn
from .dataset_config import DATASET_SCHEMAS, DatasetConfig, DatasetName, read_dataset_config
from .evaluation import CocoEvaluator
from .image_files import ImageReadError
from .synthetic import ensure_synthetic_dataset
from .transforms import make_coco_transforms

__all__ = [
    "AnnotationFileError",
    "CocoDetection",
    "CocoEvaluator",
    "DATASET_SCHEMAS",
    "DatasetConfig",
    "DatasetName",
    "EpochSampler",
    "ImageReadError",
    "build_data_loader",
    "build_dataset",
    "coco2017_paths",
    "collate_fn",
    "ensure_synthetic_dataset",
    "make_coco_transforms",
    "read_dataset_config",
]
