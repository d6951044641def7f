"""Images to run a detector on: a folder (searched recursively) or one file, read as the training data is read
(EXIF orientation applied, any PIL mode converted to RGB) and resized as the checkpoint's run evaluated.

Each item is (image (3, h, w) uint8, which the model normalizes, info) with info = {"index", "path", "orig_size"
(H, W) as the picture shows it, "size" (h, w) after resizing, and with ``keep_pixels`` "pixels", the picture as
read (3, H, W) uint8, so that drawing on it does not read the file again}; an image that cannot be read gives (None,
info with "error" naming the file), so that the reader, not a loader worker, decides what to do with it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms.v2 import functional as F

from .image_files import ImageReadError, read_image
from .transforms import make_coco_transforms

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")


def find_images(images: str | Path) -> list[Path]:
    """The image files ``images`` names: itself, or those under it (recursively, sorted by path)."""
    root = Path(images).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"images={images}: no such file or folder")
    if root.is_file():
        if root.suffix.lower() not in IMAGE_SUFFIXES:
            raise ValueError(f"images={images}: not an image file (expected one of {', '.join(IMAGE_SUFFIXES)})")
        return [root]
    found = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in IMAGE_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not found:
        raise ValueError(f"images={images}: the folder holds no image files ({', '.join(IMAGE_SUFFIXES)})")
    return found


class ImageFolder(Dataset):
    """``paths`` read and resized to ``val_size`` (short side, long side at most ``max_size``). ``image_ids``: the
    id each image is known by (predict.py's images.json, or an annotation file's), which a read error names;
    1, 2, ... in the order of ``paths`` when None, as images.json numbers a folder."""

    def __init__(
        self,
        paths: list[Path],
        *,
        val_size: int,
        max_size: int,
        keep_pixels: bool = False,
        image_ids: list[int] | None = None,
    ):
        self.paths = list(paths)
        self.image_ids = list(image_ids) if image_ids is not None else list(range(1, len(self.paths) + 1))
        if len(self.image_ids) != len(self.paths):
            raise ValueError(
                f"ImageFolder: image_ids must give one id per path, got {len(self.image_ids)} ids for "
                f"{len(self.paths)} paths"
            )
        self.keep_pixels = keep_pixels
        self.transforms = make_coco_transforms(train=False, val_size=val_size, max_size=max_size)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        path = self.paths[index]
        info = {"index": index, "path": str(path)}
        try:
            pil = read_image(path, image_id=self.image_ids[index], expected_size=(None, None))
        except ImageReadError as error:
            return None, {**info, "error": str(error)}
        image = tv_tensors.Image(F.pil_to_tensor(pil))
        height, width = image.shape[-2:]
        target = {
            "boxes": tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(height, width)),
            "labels": torch.zeros(0, dtype=torch.int64),
            "area": torch.zeros(0),
        }
        if self.keep_pixels:
            # As read: the transforms only read it (without a resize, the item's image is this same tensor).
            info["pixels"] = image.as_subclass(torch.Tensor)
        image, target = self.transforms(image, target)
        return image, {**info, "orig_size": (int(height), int(width)), "size": tuple(int(s) for s in image.shape[-2:])}
