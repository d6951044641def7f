"""COCO-format detection data: the dataset and its config adapter (batching: datasets/loader.py).

One loader for every COCO-format set: COCO 2017 and the synthetic set (which is written to disk in the
same layout) both go through :class:`CocoDetection`.

Layout (COCO 2017)::

    root/train2017/*.jpg
    root/val2017/*.jpg
    root/annotations/instances_train2017.json
    root/annotations/instances_val2017.json
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from pycocotools.coco import COCO
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.ops import box_area, box_convert, clip_boxes_to_image
from torchvision.transforms.v2 import functional as F

from .annotations import clean_annotations, load_annotation_file
from .batch_plan import PlannedSample
from .dataset_config import DatasetConfig, DatasetName, read_dataset_config
from .image_files import check_files_exist, check_images_open, read_image
from .synthetic import ensure_synthetic_dataset
from .transforms import drop_degenerate_boxes, make_coco_transforms

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
LAYOUT_HELP = (
    "expected the COCO 2017 layout: root/train2017/, root/val2017/, "
    "root/annotations/instances_train2017.json, root/annotations/instances_val2017.json"
)


def coco2017_paths(*, root: str | Path, split: str) -> tuple[Path, Path]:
    """(image_dir, annotation_file) of ``split`` under ``root``; FileNotFoundError naming what is missing."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(root)
    image_dir = root / f"{split}2017"
    annotation_file = root / "annotations" / f"instances_{split}2017.json"
    if not annotation_file.is_file():
        raise FileNotFoundError(f"annotation file not found: {annotation_file} ({LAYOUT_HELP})")
    if not image_dir.is_dir():
        raise FileNotFoundError(f"image directory not found: {image_dir} ({LAYOUT_HELP})")
    return image_dir, annotation_file


class CocoDetection(Dataset):
    """Images and box targets of a COCO-format set, through pycocotools.

    ``dataset[i]`` -> (image, target) after ``transforms``; with :func:`make_coco_transforms`:

    ``dataset[PlannedSample]`` (datasets/batch_plan.py, what the loaders ask for) -> (image, target, canvas):
    the sample's planned augmentation applied, and the (H, W) its batch is padded to.

    - image: (3, H, W) uint8 RGB pixels, which the model normalizes (models/input_pixels.py).
    - target: ``labels`` (n,) int64 COCO category ids (used directly, num_classes=91 as in the
      original); ``boxes`` (n, 4) float32 normalized cxcywh in the transformed image; ``image_id``
      () int64; ``orig_size`` (2,) int64 (h, w) of the file; ``size`` (2,) int64 (h, w) after the
      transforms; ``area`` (n,) float32; ``iscrowd`` (n,) int64 (all zero).

    Annotations are checked once, on construction (datasets/annotations.py): those that cannot be used
    (bad boxes, unknown image or category) are dropped, and reported in one warning when ``report``.
    Every listed image file must exist; with ``verify_images`` every image is also decoded once, so a
    damaged file stops the run before training rather than in the middle of it. Crowd annotations
    (iscrowd=1) are not trained on; boxes are converted xywh -> xyxy and clamped to the image, as the
    original does before augmenting. ``self.coco`` is the ground truth :class:`pycocotools.coco.COCO` for
    evaluation, without the dropped annotations.
    """

    def __init__(
        self,
        *,
        image_dir: str | Path,
        annotation_file: str | Path,
        transforms=None,
        verify_images: bool = False,
        report: bool = True,
    ) -> None:
        self.image_dir = Path(image_dir)
        self.annotation_file = Path(annotation_file)
        if not self.annotation_file.is_file():
            raise FileNotFoundError(f"annotation file not found: {self.annotation_file} ({LAYOUT_HELP})")
        if not self.image_dir.is_dir():
            raise FileNotFoundError(f"image directory not found: {self.image_dir} ({LAYOUT_HELP})")
        data, self.annotation_report = clean_annotations(load_annotation_file(self.annotation_file))
        if report and self.annotation_report.num_dropped:
            log.warning(self.annotation_report.message(self.annotation_file))
        check_files_exist(self.image_dir, data["images"], annotation_file=self.annotation_file)
        if verify_images:
            check_images_open(self.image_dir, data["images"], annotation_file=self.annotation_file)
        self.coco = coco_index(data)
        # Images without annotations stay in, as in the original (they teach "no object").
        self.ids = sorted(self.coco.imgs.keys())
        self.transforms = transforms

    @property
    def num_annotations(self) -> int:
        """Annotations trained and scored on (crowd regions only mark what evaluation ignores)."""
        return sum(1 for a in self.coco.anns.values() if not a.get("iscrowd", 0))

    def __len__(self) -> int:
        return len(self.ids)

    def image_size(self, index: int) -> tuple[int, int]:
        """(h, w) of image ``index`` as the annotation file records it (read from the file's header where it
        records none): what the loaders plan augmentation and padding with."""
        info = self.coco.imgs[self.ids[index]]
        if info.get("height") and info.get("width"):
            return int(info["height"]), int(info["width"])
        with Image.open(self.image_dir / info["file_name"]) as pil:  # the header only
            width, height = pil.size
        info["height"], info["width"] = height, width  # read_image checks the decoded size against these
        return height, width

    def load_image(self, image_id: int) -> tv_tensors.Image:
        """(3, H, W) uint8 RGB; ImageReadError (an OSError) naming the file when it cannot be used."""
        info = self.coco.imgs[image_id]
        pil = read_image(
            self.image_dir / info["file_name"], image_id=image_id, expected_size=(info.get("width"), info.get("height"))
        )
        return tv_tensors.Image(F.pil_to_tensor(pil))

    def load_target(self, image_id: int, *, height: int, width: int) -> dict[str, torch.Tensor]:
        """Target of one image before augmentation; boxes XYXY absolute in an (height, width) image."""
        anns = self.coco.loadAnns(self.coco.getAnnIds(imgIds=[image_id]))
        anns = [a for a in anns if not a.get("iscrowd", 0)]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)  # (n, 4) xywh
        boxes = clip_boxes_to_image(box_convert(boxes, "xywh", "xyxy"), (height, width))  # (n, 4) xyxy
        area = torch.tensor([a.get("area", 0.0) for a in anns], dtype=torch.float32)
        area = torch.where(area > 0, area, box_area(boxes))  # keep COCO's segment area when there is one
        target = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width)),
            "labels": torch.tensor([a["category_id"] for a in anns], dtype=torch.int64),
            "area": area,
            "iscrowd": torch.zeros(len(anns), dtype=torch.int64),
            "image_id": torch.tensor(image_id, dtype=torch.int64),
            "orig_size": torch.tensor([height, width], dtype=torch.int64),
            "size": torch.tensor([height, width], dtype=torch.int64),
        }
        return drop_degenerate_boxes(target)

    def __getitem__(self, item: int | PlannedSample):
        planned = isinstance(item, PlannedSample)
        image_id = self.ids[item.index if planned else item]
        image = self.load_image(image_id)
        height, width = image.shape[-2:]
        target = self.load_target(image_id, height=height, width=width)
        if planned:
            image, target = self.transforms.apply(image, target, item.plan)
            return image, target, item.canvas
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


def coco_index(data: dict) -> COCO:
    """pycocotools' index of annotation ``data`` (a checked, cleaned file), built quietly."""
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        coco.createIndex()
    return coco


def build_dataset(split: str, cfg_dataset: Any, *, augment: bool | None = None, check: bool = True) -> CocoDetection:
    """Config adapter: ``cfg_dataset`` (DictConfig or mapping; datasets/dataset_config.py) -> ``split``.

    ``name`` coco reads the COCO 2017 layout under ``root``; synthetic writes the set there first (on first
    use); custom reads ``{split}_images`` and ``{split}_annotations``. Transform keys default to the
    published COCO values. ``augment`` defaults to ``split == "train"``; False gives the deterministic
    validation resize (e.g. to evaluate on the training images).

    Checked here, before any training: the annotation file (see CocoDetection), that every image exists,
    that the split has annotations, and with ``check`` (rank 0; other ranks read what it checked) that every
    validation image, and every training image when ``dataset.verify``, decodes; ``check`` also reports
    dropped annotations.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    c = read_dataset_config(cfg_dataset)
    image_dir, annotation_file = split_paths(c, split)
    transforms = make_coco_transforms(
        train=(split == "train") if augment is None else augment,
        train_scales=c.train_scales,
        max_size=c.max_size,
        val_size=c.val_size,
        crop=c.crop,
        crop_scales=c.crop_scales,
        crop_min_size=c.crop_min_size,
        crop_max_size=c.crop_max_size,
    )
    dataset = CocoDetection(
        image_dir=image_dir,
        annotation_file=annotation_file,
        transforms=transforms,
        verify_images=check and (split == "val" or c.verify),
        report=check,
    )
    if dataset.num_annotations == 0:
        dropped = dataset.annotation_report.num_dropped
        raise ValueError(
            f"the {split} split has no usable annotations: {annotation_file} lists {len(dataset)} images and "
            f"{dataset.annotation_report.total} annotations"
            + (f", {dropped} of them dropped as unusable" if dropped else "")
            + (
                "; there is nothing to score detections against (COCO AP would be -1)"
                if split == "val"
                else "; there is nothing to learn from"
            )
        )
    return dataset


def split_paths(c: DatasetConfig, split: str) -> tuple[Path, Path]:
    """(image_dir, annotation_file) of ``split`` as the dataset config says; errors name the key or path."""
    if c.name == DatasetName.synthetic:
        ensure_synthetic_dataset(
            c.root,
            num_train=c.num_train,
            num_val=c.num_val,
            image_size=c.image_size,
            seed=c.seed,
            num_categories=c.num_categories,
            density=c.density,
        )
    if c.name != DatasetName.custom:
        return coco2017_paths(root=c.root, split=split)
    keys = (f"{split}_images", f"{split}_annotations")
    unset = [f"dataset.{key}" for key in keys if not getattr(c, key)]
    if unset:
        raise ValueError(
            f"dataset=custom needs {' and '.join(unset)}: the {split} split's image directory and its "
            "COCO-format annotation file"
        )
    image_dir, annotation_file = (Path(getattr(c, key)) for key in keys)
    if not image_dir.is_dir():
        raise FileNotFoundError(f"dataset.{keys[0]}: image directory not found: {image_dir}")
    if not annotation_file.is_file():
        raise FileNotFoundError(f"dataset.{keys[1]}: annotation file not found: {annotation_file}")
    return image_dir, annotation_file
