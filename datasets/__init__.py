"""COCO-format detection data: loading, checking, augmentation, the synthetic set and COCO evaluation."""

from .annotations import AnnotationFileError
from .batch_plan import BatchPlan
from .coco import CocoDetection, build_dataset, coco2017_paths
from .dataset_config import DATASET_SCHEMAS, DatasetConfig, DatasetName, read_dataset_config
from .evaluation import CocoEvaluator
from .image_files import ImageReadError
from .loader import build_data_loader, build_size_buckets, collate_fn, padded_size
from .size_buckets import SizeBuckets
from .synthetic import ensure_synthetic_dataset
from .transforms import make_coco_transforms

__all__ = [
    "DATASET_SCHEMAS",
    "AnnotationFileError",
    "BatchPlan",
    "CocoDetection",
    "CocoEvaluator",
    "DatasetConfig",
    "DatasetName",
    "ImageReadError",
    "SizeBuckets",
    "build_data_loader",
    "build_dataset",
    "build_size_buckets",
    "coco2017_paths",
    "collate_fn",
    "ensure_synthetic_dataset",
    "make_coco_transforms",
    "padded_size",
    "read_dataset_config",
]
