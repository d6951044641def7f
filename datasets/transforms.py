"""The published Deformable DETR augmentations, on torchvision.transforms.v2 and tv_tensors.

Every transform is a callable ``(image, target) -> (image, target)``:

- ``image``: ``tv_tensors.Image`` (3, H, W) uint8; :class:`Finalize` returns it as a plain uint8 tensor, which
  the model normalizes on its device (models/input_pixels.py).
- ``target``: dict with ``boxes`` (``tv_tensors.BoundingBoxes``, XYXY, absolute pixels,
  ``canvas_size`` = (H, W) of the current image), ``labels`` (n,) int64, ``area`` (n,) float32,
  ``iscrowd`` (n,) int64, ``image_id`` () int64, ``orig_size`` (2,) int64 as (h, w). After
  :class:`Finalize`, ``boxes`` is a plain (n, 4) float32 tensor in normalized cxcywh and
  ``size`` (2,) int64 is the (h, w) of the transformed image.

torchvision's v2 kernels move and clamp the boxes together with the pixels (flip, resize, crop).
:func:`make_coco_transforms` composes the recipe of the original repository.

Each random transform draws its choices in ``plan(size, rng)`` and applies them in ``apply(image, target,
params)``, so the choices for an image, and the size it comes out at, can be drawn before the image is read:
the training loader does that (datasets/batch_plan.py) to group images of similar output size into a
batch. ``rng`` is anything with ``randint(low, high)`` (inclusive) and ``random()``: a ``random.Random``
there. Calling a transform draws from torch's global RNG instead and applies at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torchvision import tv_tensors
from torchvision.ops import box_area
from torchvision.transforms.v2 import functional as F

# The published recipe (Deformable DETR, inherited from DETR).
COCO_TRAIN_SCALES = tuple(range(480, 801, 32))  # 480, 512, ..., 800
COCO_MAX_SIZE = 1333
COCO_VAL_SIZE = 800
COCO_CROP_SCALES = (400, 500, 600)
COCO_CROP_MIN_SIZE = 384
COCO_CROP_MAX_SIZE = 600

Transform = Callable[[torch.Tensor, dict], tuple]
Size = tuple[int, int]  # (height, width)


class Rng(Protocol):
    def randint(self, low: int, high: int) -> int: ...  # uniform in [low, high], inclusive

    def random(self) -> float: ...  # uniform in [0, 1)


class TorchGlobalRng:
    """The Rng protocol on torch's global generator (what calling a transform draws from)."""

    @staticmethod
    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, ()).item())

    @staticmethod
    def random() -> float:
        return float(torch.rand(()))


class Planned:
    """A transform whose random choices are drawn apart from applying them (see the module docstring)."""

    def plan(self, size: Size, rng: Rng) -> tuple[Any, Size]:
        """(params for ``apply``, the (h, w) an image of ``size`` has after it)."""
        raise NotImplementedError

    def apply(self, image, target: dict, params):
        raise NotImplementedError

    def __call__(self, image, target):
        params, _ = self.plan(tuple(image.shape[-2:]), TorchGlobalRng())
        return self.apply(image, target, params)


def size_with_aspect_ratio(*, height: int, width: int, size: int, max_size: int | None) -> tuple[int, int]:
    """Output (h, w) whose short side is ``size`` and long side at most ``max_size``, keeping aspect.

    Same arithmetic as the original repository's ``get_size_with_aspect_ratio`` (floor on the long
    side, rounding when the long-side cap lowers the short side), so images and boxes get the same
    pixel sizes as in published training runs.
    """
    if max_size is not None:
        short, long = float(min(height, width)), float(max(height, width))
        if long / short * size > max_size:
            size = round(max_size * short / long)
    if (width <= height and width == size) or (height <= width and height == size):
        return height, width
    if width < height:
        return int(size * height / width), size
    return size, int(size * width / height)


def drop_degenerate_boxes(target: dict) -> dict:
    """Remove boxes with zero width or height, together with their labels, area and iscrowd.

    Written by hand rather than with ``v2.SanitizeBoundingBoxes`` because that one refuses a
    ``min_size`` below one pixel, while the original keeps every box of positive extent (COCO has
    sub-pixel annotations that become visible after upscaling).
    """
    boxes = target["boxes"]  # (n, 4) XYXY
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])  # (n,)
    if bool(keep.all()):
        return target
    target = dict(target)
    for key in ("labels", "area", "iscrowd"):
        if key in target:
            target[key] = target[key][keep]
    kept = boxes[keep]
    if isinstance(boxes, tv_tensors.BoundingBoxes):
        # Indexing a tv_tensor returns a plain tensor; re-wrap so later v2 kernels still see boxes.
        kept = tv_tensors.wrap(kept, like=boxes)
    target["boxes"] = kept
    return target


class RandomHorizontalFlip(Planned):
    """Mirror image and boxes with probability ``p`` (v2 kernel: x -> W - x on both box edges)."""

    def __init__(self, *, p: float = 0.5) -> None:
        self.p = p

    def plan(self, size: Size, rng: Rng) -> tuple[bool, Size]:
        return rng.random() < self.p, size

    def apply(self, image, target, flip: bool):
        if not flip:
            return image, target
        target = dict(target)
        target["boxes"] = F.horizontal_flip(target["boxes"])
        return F.horizontal_flip(image), target


class RandomResize(Planned):
    """Resize so the short side is a size drawn from ``sizes``, long side capped at ``max_size``.

    Boxes are scaled by (new_w / w, new_h / h) through the v2 kernel; ``area`` by their product.
    """

    def __init__(self, *, sizes: Sequence[int], max_size: int | None = None) -> None:
        if len(sizes) == 0:
            raise ValueError("RandomResize needs at least one size, got an empty list")
        self.sizes = [int(s) for s in sizes]
        self.max_size = max_size

    def plan(self, size: Size, rng: Rng) -> tuple[Size, Size]:
        short = self.sizes[rng.randint(0, len(self.sizes) - 1)]
        new = size_with_aspect_ratio(height=size[0], width=size[1], size=short, max_size=self.max_size)
        return new, new

    def apply(self, image, target, new_size: Size):
        height, width = image.shape[-2:]
        new_h, new_w = new_size
        image = F.resize(image, size=[new_h, new_w], antialias=True)
        target = dict(target)
        target["boxes"] = F.resize(target["boxes"], size=[new_h, new_w])
        target["area"] = target["area"] * ((new_w / width) * (new_h / height))
        return image, target


def crop(image, target: dict, *, top: int, left: int, height: int, width: int):
    """Cut the window [top, top + height) x [left, left + width) out of image and boxes.

    Boxes are shifted and clipped to the window by the v2 kernel; those left with zero width or
    height are dropped; ``area`` is recomputed from the clipped box, as in the original.
    """
    image = F.crop(image, top=top, left=left, height=height, width=width)
    target = dict(target)
    boxes = F.crop(target["boxes"], top=top, left=left, height=height, width=width)  # (n, 4) clamped
    target["boxes"] = boxes
    target["area"] = box_area(boxes.as_subclass(torch.Tensor))  # (n,)
    return image, drop_degenerate_boxes(target)


class RandomSizeCrop(Planned):
    """Crop a random window of h, w in [min_size, min(side, max_size)] at a random place (see :func:`crop`).

    When the image is smaller than ``min_size`` the window spans that whole side (the original
    would raise).
    """

    def __init__(self, *, min_size: int, max_size: int) -> None:
        if min_size > max_size:
            raise ValueError(f"RandomSizeCrop needs min_size <= max_size, got {min_size} > {max_size}")
        self.min_size = int(min_size)
        self.max_size = int(max_size)

    def plan(self, size: Size, rng: Rng) -> tuple[tuple[int, int, int, int], Size]:
        height, width = size
        crop_w = rng.randint(min(self.min_size, width), min(width, self.max_size))
        crop_h = rng.randint(min(self.min_size, height), min(height, self.max_size))
        top = rng.randint(0, height - crop_h)
        left = rng.randint(0, width - crop_w)
        return (top, left, crop_h, crop_w), (crop_h, crop_w)

    def apply(self, image, target, window: tuple[int, int, int, int]):
        top, left, height, width = window
        return crop(image, target, top=top, left=left, height=height, width=width)


class RandomSelect(Planned):
    """Apply ``first`` with probability ``p``, otherwise ``second`` (both Planned)."""

    def __init__(self, *, first: Planned, second: Planned, p: float = 0.5) -> None:
        self.first, self.second, self.p = first, second, p

    def plan(self, size: Size, rng: Rng):
        chosen = 0 if rng.random() < self.p else 1
        params, size = (self.first, self.second)[chosen].plan(size, rng)
        return (chosen, params), size

    def apply(self, image, target, params):
        chosen, inner = params
        return (self.first, self.second)[chosen].apply(image, target, inner)


class Compose(Planned):
    """Apply transforms (Planned) in order."""

    def __init__(self, transforms: Sequence[Planned]) -> None:
        self.transforms = list(transforms)

    def plan(self, size: Size, rng: Rng) -> tuple[list, Size]:
        params = []
        for transform in self.transforms:
            p, size = transform.plan(size, rng)
            params.append(p)
        return params, size

    def apply(self, image, target, params: list):
        for transform, p in zip(self.transforms, params):
            image, target = transform.apply(image, target, p)
        return image, target


class Finalize(Planned):
    """The image as plain uint8 pixels; boxes to normalized cxcywh plain tensors.

    Output: image (3, H, W) uint8, normalized by the model where it runs (a quarter of float32's bytes between
    the loader's processes and to the GPU); target ``boxes`` (n, 4) float32 cxcywh in [0, 1] relative to the
    transformed (H, W); ``size`` = (H, W) int64. tv_tensor subclasses are stripped so that the model and
    criterion see ordinary tensors.
    """

    def plan(self, size: Size, rng: Rng) -> tuple[None, Size]:
        return None, size

    def apply(self, image, target, params=None):
        height, width = image.shape[-2:]
        if image.dtype != torch.uint8:
            raise ValueError(f"Finalize takes uint8 pixels, got {image.dtype}")
        target = dict(target)
        boxes = F.convert_bounding_box_format(target["boxes"], new_format=tv_tensors.BoundingBoxFormat.CXCYWH)
        scale = torch.tensor([width, height, width, height], dtype=torch.float32)
        target["boxes"] = boxes.as_subclass(torch.Tensor).to(torch.float32) / scale  # (n, 4) cxcywh
        target["area"] = target["area"].to(torch.float32)
        target["size"] = torch.tensor([height, width], dtype=torch.int64)
        return image.as_subclass(torch.Tensor), target


def make_coco_transforms(
    *,
    train: bool,
    train_scales: Sequence[int] = COCO_TRAIN_SCALES,
    max_size: int = COCO_MAX_SIZE,
    val_size: int = COCO_VAL_SIZE,
    crop: bool = True,
    crop_scales: Sequence[int] = COCO_CROP_SCALES,
    crop_min_size: int = COCO_CROP_MIN_SIZE,
    crop_max_size: int = COCO_CROP_MAX_SIZE,
) -> Compose:
    """The original recipe; defaults are the published COCO values.

    train: flip, then either RandomResize(train_scales, max_size) or (with ``crop``, half the time)
    RandomResize(crop_scales) -> RandomSizeCrop(crop_min_size, crop_max_size) ->
    RandomResize(train_scales, max_size); then finalize. val: RandomResize([val_size], max_size),
    finalize. The sizes are parameters so that small synthetic images can use small scales.
    """
    finalize = Finalize()
    if not train:
        return Compose([RandomResize(sizes=[val_size], max_size=max_size), finalize])
    resize = RandomResize(sizes=train_scales, max_size=max_size)
    if crop:
        resize = RandomSelect(
            first=resize,
            second=Compose(
                [
                    RandomResize(sizes=crop_scales),
                    RandomSizeCrop(min_size=crop_min_size, max_size=crop_max_size),
                    RandomResize(sizes=train_scales, max_size=max_size),
                ]
            ),
        )
    return Compose([RandomHorizontalFlip(p=0.5), resize, finalize])
