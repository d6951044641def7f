"""The detector as an exported graph sees it (docs/export.md).

Inputs, in order: images (B, 3, H, W) in the export dtype, RGB normalized with ImageNet's mean and std, H and W
multiples of 32, smaller images padded at the bottom and right; mask (B, H, W) bool, True on padding; with
postprocess=true, target_sizes (B, 2) int64 (h, w), the size the boxes are given in. Outputs: pred_logits
(B, Q, num_classes; sigmoid per class, no background class) and pred_boxes (B, Q, 4; normalized cx, cy, w, h of the
unpadded region), or with postprocess=true the top k = max_detections (query, class) pairs: scores (B, k), labels
(B, k) int64 and boxes (B, k, 4) x0, y0, x1, y1 in target_sizes' pixels."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from engine.config.export_schema import SIDE_MULTIPLE
from models.frozen_batch_norm import FrozenBatchNorm2d
from models.postprocess import PostProcess

# The largest side (4096 px) and batch a dynamic graph takes; inputs outside the range are not checked at run
# time (AOTInductor does with AOTI_RUNTIME_CHECK_INPUTS=1) and give wrong results.
LARGEST_MULTIPLE = 128
LARGEST_BATCH = 1024


class ExportableDetector(nn.Module):
    """``model.detect`` (DeformableDETR) with, when ``postprocess`` is given, its top-k selection, on tensors."""

    def __init__(self, model: nn.Module, postprocess: PostProcess | None = None):
        super().__init__()
        self.model = model
        self.postprocess = postprocess
        self.input_names = ("images", "mask") if postprocess is None else ("images", "mask", "target_sizes")
        self.output_names = ("pred_logits", "pred_boxes") if postprocess is None else ("scores", "labels", "boxes")

    def forward(self, images: torch.Tensor, mask: torch.Tensor, target_sizes: torch.Tensor | None = None):
        outputs = self.model.detect(images, mask)
        if self.postprocess is None:
            return outputs["pred_logits"], outputs["pred_boxes"]
        return self.postprocess.batched(outputs, target_sizes)


class ChannelAffine(nn.Module):
    """A FrozenBatchNorm2d as x * scale + shift, worked out once (as its eager forward caches it): fewer nodes."""

    def __init__(self, batch_norm: FrozenBatchNorm2d):
        super().__init__()
        scale, shift = batch_norm._affine_of(*batch_norm._statistics(), dtype=batch_norm.weight.dtype)
        self.register_buffer("scale", scale)  # (1, C, 1, 1)
        self.register_buffer("shift", shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, x, self.scale)


def for_tracing(detector: ExportableDetector) -> ExportableDetector:
    """A copy of ``detector`` whose frozen batch norms are ChannelAffines (bitwise the same values); ``detector``
    itself is left as it is, for the parity check to compare with."""
    traced = copy.deepcopy(detector)
    for module in list(traced.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FrozenBatchNorm2d):
                setattr(module, name, ChannelAffine(child))
    return traced


@dataclass(frozen=True)
class SampleShape:
    """The sample's batch and image size, which a static graph is fixed at."""

    batch: int
    height: int
    width: int


def smallest_multiple(model: nn.Module) -> int:
    """The least h such that an image side of 32 * h gives every feature level of ``model`` (a DeformableDETR) at
    least 2 pixels (torch.export specializes a dimension it sees at size 1)."""
    for multiple in itertools.count(1):
        sides = [SIDE_MULTIPLE * multiple // stride for stride in model.backbone.strides]
        for _ in range(model.num_feature_levels - len(sides)):
            sides.append((sides[-1] - 1) // 2 + 1)  # the extra levels' 3x3 stride-2 convolutions, padding 1
        if min(sides) >= 2:
            return multiple


def trace(
    detector: ExportableDetector, inputs: tuple[torch.Tensor, ...], *, dynamic: bool
) -> torch.export.ExportedProgram:
    """torch.export of ``detector`` on ``inputs``, with dynamic batch and sides (multiples of 32) or fixed at the
    inputs' shape; a ValueError naming image_size when the images are too small for the model's feature levels."""
    height, width = inputs[0].shape[-2:]
    least = SIDE_MULTIPLE * smallest_multiple(detector.model)
    if min(height, width) < least:
        raise ValueError(
            f"image_size must be at least {least} x {least} for this model (its smallest feature level "
            f"needs 2 pixels a side), got {height} x {width}"
        )
    shapes = None
    if dynamic:
        batch = torch.export.Dim("batch", min=1, max=LARGEST_BATCH)
        rows = SIDE_MULTIPLE * torch.export.Dim("rows_of_32", min=least // SIDE_MULTIPLE, max=LARGEST_MULTIPLE)
        columns = SIDE_MULTIPLE * torch.export.Dim("columns_of_32", min=least // SIDE_MULTIPLE, max=LARGEST_MULTIPLE)
        shapes = {"images": {0: batch, 2: rows, 3: columns}, "mask": {0: batch, 1: rows, 2: columns}}
        if detector.postprocess is not None:
            shapes["target_sizes"] = {0: batch}
    with torch.no_grad():
        return torch.export.export(for_tracing(detector).eval(), inputs, dynamic_shapes=shapes)
