"""COCO-format detection data: the dataset, its config adapter, batch collation and the loader.

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
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from PIL import Image
from pycocotools.coco import COCO
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision import tv_tensors
from torchvision.ops import box_area, box_convert, clip_boxes_to_image
from torchvision.transforms.v2 import functional as F

from .synthetic import ensure_synthetic_dataset
from .transforms import (
    COCO_CROP_MAX_SIZE,
    COCO_CROP_MIN_SIZE,
    COCO_CROP_SCALES,
    COCO_MAX_SIZE,
    COCO_TRAIN_SCALES,
    COCO_VAL_SIZE,
    drop_degenerate_boxes,
    make_coco_transforms,
)

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

    - image: (3, H, W) float32, normalized with the ImageNet mean/std.
    - target: ``labels`` (n,) int64 COCO category ids (used directly, num_classes=91 as in the
      original); ``boxes`` (n, 4) float32 normalized cxcywh in the transformed image; ``image_id``
      () int64; ``orig_size`` (2,) int64 (h, w) of the file; ``size`` (2,) int64 (h, w) after the
      transforms; ``area`` (n,) float32; ``iscrowd`` (n,) int64 (all zero).

    Crowd annotations (iscrowd=1) are dropped; boxes are converted xywh -> xyxy, clamped to the
    image, and those with zero width or height dropped, as the original does before augmenting.
    ``self.coco`` is the ground-truth :class:`pycocotools.coco.COCO` for evaluation.
    """

    def __init__(self, *, image_dir: str | Path, annotation_file: str | Path, transforms=None) -> None:
        self.image_dir = Path(image_dir)
        annotation_file = Path(annotation_file)
        if not annotation_file.is_file():
            raise FileNotFoundError(f"annotation file not found: {annotation_file} ({LAYOUT_HELP})")
        if not self.image_dir.is_dir():
            raise FileNotFoundError(f"image directory not found: {self.image_dir} ({LAYOUT_HELP})")
        # pycocotools prints progress lines on load; keep them out of the training log.
        with contextlib.redirect_stdout(io.StringIO()):
            self.coco = COCO(str(annotation_file))
        # Images without annotations stay in, as in the original (they teach "no object").
        self.ids = sorted(self.coco.imgs.keys())
        self.transforms = transforms

    def __len__(self) -> int:
        return len(self.ids)

    def load_image(self, image_id: int) -> tv_tensors.Image:
        """(3, H, W) uint8 RGB; OSError naming the file when it is missing or cannot be decoded."""
        info = self.coco.imgs[image_id]
        path = self.image_dir / info["file_name"]
        try:
            with Image.open(path) as pil:
                pil = pil.convert("RGB")  # decodes fully here, so truncated files fail here
        except (OSError, ValueError, SyntaxError) as error:
            raise OSError(f"cannot read image {path} (image id {image_id}): {error}") from error
        width, height = pil.size
        expected = (info.get("width", width), info.get("height", height))
        if (width, height) != expected:
            # The annotations are in the json's pixel frame; a different file would silently
            # misplace every box and every evaluated detection.
            raise ValueError(
                f"image {path} is {width}x{height} but the annotation file says {expected[0]}x{expected[1]}"
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

    def __getitem__(self, index: int):
        image_id = self.ids[index]
        image = self.load_image(image_id)
        height, width = image.shape[-2:]
        target = self.load_target(image_id, height=height, width=width)
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


def _cfg_get(cfg: Any, key: str, default: Any) -> Any:
    value = cfg.get(key, default) if cfg is not None else default
    return default if value is None else value


def build_dataset(split: str, cfg_dataset: Any, *, augment: bool | None = None) -> CocoDetection:
    """Config adapter: ``cfg_dataset`` (DictConfig or dict) -> :class:`CocoDetection` of ``split``.

    Keys: ``name`` (coco | synthetic), ``root``; synthetic only: ``num_train``, ``num_val``,
    ``image_size``, ``seed``, ``num_categories`` (the set is generated under ``root`` on first use); transforms (all
    optional, published COCO values by default): ``train_scales``, ``max_size``, ``val_size``,
    ``crop``, ``crop_scales``, ``crop_min_size``, ``crop_max_size``.
    ``augment`` defaults to ``split == "train"``; False gives the deterministic validation resize
    (e.g. to evaluate on the training images).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    name = _cfg_get(cfg_dataset, "name", "coco")
    root = _cfg_get(cfg_dataset, "root", None)
    if root is None:
        raise ValueError("dataset.root is required (a COCO 2017 directory, or where to write the synthetic set)")
    if name == "synthetic":
        ensure_synthetic_dataset(
            root,
            num_train=int(_cfg_get(cfg_dataset, "num_train", 256)),
            num_val=int(_cfg_get(cfg_dataset, "num_val", 64)),
            image_size=int(_cfg_get(cfg_dataset, "image_size", 128)),
            seed=int(_cfg_get(cfg_dataset, "seed", 0)),
            num_categories=_cfg_get(cfg_dataset, "num_categories", None),  # None: all six
        )
    elif name != "coco":
        raise ValueError(f"dataset.name must be 'coco' or 'synthetic', got {name!r}")
    image_dir, annotation_file = coco2017_paths(root=root, split=split)
    transforms = make_coco_transforms(
        train=(split == "train") if augment is None else augment,
        train_scales=[int(s) for s in _cfg_get(cfg_dataset, "train_scales", COCO_TRAIN_SCALES)],
        max_size=int(_cfg_get(cfg_dataset, "max_size", COCO_MAX_SIZE)),
        val_size=int(_cfg_get(cfg_dataset, "val_size", COCO_VAL_SIZE)),
        crop=bool(_cfg_get(cfg_dataset, "crop", True)),
        crop_scales=[int(s) for s in _cfg_get(cfg_dataset, "crop_scales", COCO_CROP_SCALES)],
        crop_min_size=int(_cfg_get(cfg_dataset, "crop_min_size", COCO_CROP_MIN_SIZE)),
        crop_max_size=int(_cfg_get(cfg_dataset, "crop_max_size", COCO_CROP_MAX_SIZE)),
    )
    return CocoDetection(image_dir=image_dir, annotation_file=annotation_file, transforms=transforms)


def collate_fn(batch: list) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """[(image (3, h_i, w_i), target)] -> images (B, 3, Hmax, Wmax), masks (B, Hmax, Wmax), targets.

    Images are zero padded at the bottom and right (boxes stay relative to the unpadded image, as the
    model's mask tells it where the image ends); masks are True on padding.
    """
    images, targets = zip(*batch)
    height = max(image.shape[-2] for image in images)
    width = max(image.shape[-1] for image in images)
    padded = images[0].new_zeros((len(images), images[0].shape[0], height, width))  # (B, 3, Hmax, Wmax)
    masks = torch.ones((len(images), height, width), dtype=torch.bool)  # (B, Hmax, Wmax)
    for i, image in enumerate(images):
        h, w = image.shape[-2:]
        padded[i, :, :h, :w] = image
        masks[i, :h, :w] = False
    return padded, masks, list(targets)


class EpochSampler(Sampler[int]):
    """Single-process sampler with ``set_epoch``: order depends only on (seed, epoch).

    The same interface as DistributedSampler, so the training loop calls ``set_epoch`` either way,
    and a run resumed at epoch e sees the same order as one that never stopped.
    """

    def __init__(self, *, size: int, shuffle: bool, seed: int = 0) -> None:
        self.size, self.shuffle, self.seed, self.epoch = size, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


def build_data_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    num_workers: int,
    train: bool,
    seed: int = 0,
    distributed: bool | None = None,
    drop_last: bool | None = None,
) -> DataLoader:
    """DataLoader yielding ``collate_fn`` batches: (images, masks, targets).

    ``distributed`` (default: whether torch.distributed is initialized) selects DistributedSampler,
    which splits the set over ranks (and pads with repeats so every rank gets the same count; the
    evaluator de-duplicates). Otherwise :class:`EpochSampler`. Either way ``loader.sampler.set_epoch``
    exists. ``drop_last`` defaults to ``train``. The generator (seed + rank) fixes the worker seeds,
    from which each worker seeds torch and ``random``, so augmentations are reproducible.
    """
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    if distributed:
        sampler: Sampler = DistributedSampler(dataset, shuffle=train, seed=seed, drop_last=False)
    else:
        sampler = EpochSampler(size=len(dataset), shuffle=train, seed=seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=train if drop_last is None else drop_last,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed + rank),
    )
