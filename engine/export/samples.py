"""The sample batch an export is traced on and checked with: the first validation images of the checkpoint's
run when its folder exists here (real activations make the parity check mean something), resized to fit with
their aspect ratio and padded; else random normalized noise, images after the first padded to exercise the mask.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from torchvision.transforms.v2 import functional as F

from datasets.image_files import read_image
from datasets.image_folder import find_images
from models.input_pixels import InputPixels

from .exportable import SampleShape


@dataclass
class SampleBatch:
    """images (B, 3, H, W) float32 normalized, mask (B, H, W) bool True on padding, target_sizes (B, 2) int64
    (h, w) of each original image; ``source`` says where the pictures came from (for the log)."""

    images: torch.Tensor
    mask: torch.Tensor
    target_sizes: torch.Tensor
    source: str

    def inputs(self, *, postprocess: bool, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The exported graph's inputs (engine/export/exportable.py), on ``device``, images in ``dtype``."""
        inputs = (self.images.to(device=device, dtype=dtype), self.mask.to(device))
        return inputs + ((self.target_sizes.to(device),) if postprocess else ())


def recorded_validation_folder(config: dict | None) -> Path | None:
    """The validation image folder the checkpoint's run config names (coco, synthetic: root/val2017; custom:
    val_images) if it exists here; relative paths from the current directory, as train.py takes them."""
    dataset = config.get("dataset") if isinstance(config, dict) else None
    if not isinstance(dataset, dict):
        return None
    if dataset.get("name") in ("coco", "synthetic") and dataset.get("root"):
        folder = Path(dataset["root"]) / "val2017"
    elif dataset.get("name") == "custom" and dataset.get("val_images"):
        folder = Path(dataset["val_images"])
    else:
        return None
    return folder if folder.is_dir() else None


def sample_batch(shape: SampleShape, *, folder: Path | None, seed: int = 0) -> SampleBatch:
    """The first ``shape.batch`` images of ``folder`` (sorted by path; cycled when there are fewer), else noise."""
    try:
        paths = find_images(folder)[: shape.batch] if folder is not None else []
    except ValueError:  # a folder without images: the batch is noise then
        paths = []
    if not paths:
        return random_batch(shape, seed=seed)
    images = torch.zeros(shape.batch, 3, shape.height, shape.width)
    mask = torch.ones(shape.batch, shape.height, shape.width, dtype=torch.bool)
    sizes = []
    for index, path in zip(range(shape.batch), itertools.cycle(paths)):
        pixels = F.pil_to_tensor(read_image(path, image_id=index, expected_size=(None, None)))  # (3, H, W) uint8
        height, width = (int(s) for s in pixels.shape[-2:])
        scale = min(shape.height / height, shape.width / width)  # fitted, its aspect ratio kept
        h, w = min(shape.height, max(1, round(height * scale))), min(shape.width, max(1, round(width * scale)))
        images[index, :, :h, :w] = InputPixels().normalize(F.resize(pixels, [h, w], antialias=True))
        mask[index, :h, :w] = False
        sizes.append((height, width))
    return SampleBatch(
        images=images,
        mask=mask,
        target_sizes=torch.tensor(sizes, dtype=torch.int64),
        source=f"{len(paths)} validation image(s) of {folder}",
    )


def random_batch(shape: SampleShape, *, seed: int = 0) -> SampleBatch:
    """Noise images; image i > 0 keeps a random valid region of at least half of each side, the rest padding."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(shape.batch, 3, shape.height, shape.width, generator=generator)
    mask = torch.zeros(shape.batch, shape.height, shape.width, dtype=torch.bool)
    sizes = []
    for index in range(shape.batch):
        h, w = shape.height, shape.width
        if index > 0:
            h = int(torch.randint(shape.height // 2, shape.height + 1, (), generator=generator))
            w = int(torch.randint(shape.width // 2, shape.width + 1, (), generator=generator))
        mask[index, h:, :] = True
        mask[index, :, w:] = True
        sizes.append((h, w))
    images.masked_fill_(mask[:, None], 0)
    source = f"random images (seed {seed}; no validation images recorded in the checkpoint were found)"
    return SampleBatch(images=images, mask=mask, target_sizes=torch.tensor(sizes, dtype=torch.int64), source=source)
