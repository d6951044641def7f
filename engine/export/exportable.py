"""The detector as an exported graph sees it: tensors in, a tuple of tensors out, and the sizes that may vary.

Inputs (what an ONNX file or an AOTInductor package takes, in this order):
    images        (B, 3, H, W) in the export dtype, RGB normalized with ImageNet's mean and std (as in training),
                  H and W multiples of 32, smaller images padded at the bottom and right
    mask          (B, H, W) bool, True on padding
    target_sizes  (B, 2) int64 (h, w), only with postprocess=true: the size the boxes are given in
Outputs:
    postprocess=false: pred_logits (B, Q, num_classes) (sigmoid per class; no background class), pred_boxes
                       (B, Q, 4) normalized (cx, cy, w, h) of the unpadded region
    postprocess=true:  scores (B, k), labels (B, k) int64, boxes (B, k, 4) (x0, y0, x1, y1) in target_sizes'
                       pixels: the top k = max_detections (query, class) pairs (models/postprocess.py)

Dynamic sizes: the batch, and H = 32 * h, W = 32 * w. torch.export specializes a dimension it sees at size 1, so
every feature level needs at least 2 rows and columns: ``smallest_multiple`` gives the least h (and w).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from engine.config.export_schema import SIDE_MULTIPLE
from models.frozen_batch_norm import FrozenBatchNorm2d
from models.postprocess import PostProcess

RAW_OUTPUTS = ("pred_logits", "pred_boxes")
DETECTION_OUTPUTS = ("scores", "labels", "boxes")
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

    @property
    def input_names(self) -> tuple[str, ...]:
        return ("images", "mask") + (("target_sizes",) if self.postprocess is not None else ())

    @property
    def output_names(self) -> tuple[str, ...]:
        return RAW_OUTPUTS if self.postprocess is None else DETECTION_OUTPUTS

    def forward(self, images: torch.Tensor, mask: torch.Tensor, target_sizes: torch.Tensor | None = None):
        outputs = self.model.detect(images, mask)
        logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
        if self.postprocess is None:
            return logits, boxes
        return self.postprocess.batched({"pred_logits": logits, "pred_boxes": boxes}, target_sizes)


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


def feature_level_sides(side: int, model: nn.Module) -> list[int]:
    """Each feature level's side of ``model`` (a DeformableDETR) for an image side of ``side`` pixels."""
    sides = [side // stride for stride in model.backbone.strides]
    for _ in range(model.num_feature_levels - len(sides)):
        sides.append((sides[-1] - 1) // 2 + 1)  # the extra levels' 3x3 stride-2 convolutions, padding 1
    return sides


def smallest_multiple(model: nn.Module) -> int:
    """The least h such that an image side of 32 * h gives every feature level of ``model`` at least 2 pixels."""
    multiple = 1
    while min(feature_level_sides(SIDE_MULTIPLE * multiple, model)) < 2:
        multiple += 1
    return multiple


def dynamic_shapes(detector: ExportableDetector) -> dict:
    """torch.export's dynamic_shapes for ``detector``'s inputs: any batch, sides 32 * h and 32 * w."""
    least = smallest_multiple(detector.model)
    batch = torch.export.Dim("batch", min=1, max=LARGEST_BATCH)
    rows = torch.export.Dim("rows_of_32", min=least, max=LARGEST_MULTIPLE)
    columns = torch.export.Dim("columns_of_32", min=least, max=LARGEST_MULTIPLE)
    height, width = SIDE_MULTIPLE * rows, SIDE_MULTIPLE * columns
    shapes = {"images": {0: batch, 2: height, 3: width}, "mask": {0: batch, 1: height, 2: width}}
    if detector.postprocess is not None:
        shapes["target_sizes"] = {0: batch}
    return shapes


def trace(detector: ExportableDetector, inputs: tuple[torch.Tensor, ...], *,
          dynamic: bool) -> torch.export.ExportedProgram:
    """torch.export of ``detector`` on ``inputs``, with dynamic batch and sides or fixed at the inputs' shape; a
    ValueError naming image_size when the images are too small for the model's feature levels."""
    height, width = inputs[0].shape[-2:]
    least = SIDE_MULTIPLE * smallest_multiple(detector.model)
    if min(height, width) < least:
        raise ValueError(f"image_size must be at least {least} x {least} for this model (its smallest feature level "
                         f"needs 2 pixels a side), got {height} x {width}")
    shapes = dynamic_shapes(detector) if dynamic else None
    with torch.no_grad():
        return torch.export.export(for_tracing(detector).eval(), inputs, dynamic_shapes=shapes)
