"""The model's input: images as uint8 pixels, normalized where the model runs.

The loaders hand over uint8 pixels: a quarter of the bytes of float32 through the workers' shared memory, the
pinned copy and the copy to the GPU, and no float conversion in the workers. The model turns them into what
the ImageNet-trained ResNet expects, ``(pixels / 255 - mean) / std`` in float32, and sets the padding to 0 as a
loader that normalized on the host padded it. A float image is taken as already normalized.
"""

from __future__ import annotations

import torch
from torch import nn

# The normalization the ResNet's ImageNet weights were trained with (torchvision's, as the original's).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class InputPixels(nn.Module):
    """forward(images (B, 3, H, W) or (3, H, W), mask (B, H, W) or (H, W) bool True on padding, or None) -> what
    the backbone takes: uint8 pixels normalized (``normalize``), float images as they are.

    The mean and std are buffers, so that they are on the model's device before a step runs: made from Python
    numbers during the step, they would be copied from the host, which a CUDA graph cannot record. They are
    constants, not in the state_dict (the official checkpoints have no such keys).
    """

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN, dtype=torch.float32).view(3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD, dtype=torch.float32).view(3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.normalize(images, mask) if images.dtype == torch.uint8 else images

    def normalize(self, pixels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 RGB ``pixels`` -> float32 of the same shape, ImageNet-normalized, 0 where ``mask`` is True. The
        arithmetic is torchvision's ``normalize(to_dtype(image, float32, scale=True))``, in the same order."""
        if pixels.dtype != torch.uint8:
            raise ValueError(f"pixels must be uint8 to normalize, got {pixels.dtype}")
        if pixels.device != self.mean.device:
            raise ValueError(
                f"pixels are on {pixels.device} and the model on {self.mean.device}: move one to the other"
            )
        normalized = (pixels.to(torch.float32) * (1.0 / 255) - self.mean) / self.std
        if mask is not None:
            normalized = normalized.masked_fill(mask.unsqueeze(-3), 0.0)
        return normalized
