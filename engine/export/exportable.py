"""The detector as an exported graph sees it: tensors in, a tuple of tensors out, and the sizes that may vary.

Inputs (what an ONNX file or an AOTInductor package takes, in this order):
    images        (B, 3, H, W) in the export dtype: RGB normalized with ImageNet's mean and std (as training does),
                  H and W multiples of 32, images of different sizes padded at the bottom and right
    mask          (B, H, W) bool, True on padding (all False for a batch of one size)
    target_sizes  (B, 2) int64 (h, w): only with postprocess=true, the size the boxes are given in (the
                  original image's, as predict.py uses)
Outputs:
    postprocess=false: pred_logits (B, Q, num_classes) (sigmoid gives each class's probability; no background
                       class), pred_boxes (B, Q, 4) normalized (cx, cy, w, h) of the valid (unpadded) region
    postprocess=true:  scores (B, k), labels (B, k) int64, boxes (B, k, 4) (x0, y0, x1, y1) in target_sizes'
                       pixels: the top k = max_detections (query, class) pairs, as models/postprocess.py

Sizes: the batch, and H = 32 * h, W = 32 * w (torch.export.Dim) when dynamic. Every feature level must keep at
least 2 rows and columns: torch.export specializes a dimension it sees at size 1 (broadcasting differs there),
so ``smallest_multiple`` gives the least h (and w) the graph takes, e.g. 2 (64 px) for the three backbone levels
and 3 (96 px) with the paper's fourth, stride-64 level.
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
# The largest side (4096 px) and batch a dynamic graph is traced for. Neither format checks its inputs against
# the range at run time (AOTInductor does with AOTI_RUNTIME_CHECK_INPUTS=1): outside it, nor below the smallest
# side, the results are not what the model computes.
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
    """x * scale + shift per channel, with scale and shift fixed: what a FrozenBatchNorm2d computes, its affine
    worked out once (as its eager forward caches it) instead of from the four statistics in every graph."""

    def __init__(self, batch_norm: FrozenBatchNorm2d):
        super().__init__()
        scale, shift = batch_norm._affine_of(*batch_norm._statistics(), dtype=batch_norm.weight.dtype)
        self.register_buffer("scale", scale)  # (1, C, 1, 1)
        self.register_buffer("shift", shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, x, self.scale)


def for_tracing(detector: ExportableDetector) -> ExportableDetector:
    """A copy of ``detector`` whose frozen batch norms are ChannelAffines: the same values (bitwise: the eager
    forward computes the same affine with the same ops) from fewer graph nodes (937 -> 677 for the tests' tiny
    ResNet-18 model), so a quicker export and fewer kernels to run. ``detector`` itself is left as it is: the
    parity check compares the exported graph with it."""
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
    """The side each feature level of ``model`` (a DeformableDETR) has for an image side of ``side`` pixels
    (a multiple of 32): side / stride for the backbone's levels, then halved (rounded up) per extra level."""
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


def check_sample_shape(shape: SampleShape, model: nn.Module) -> None:
    """ValueError naming image_size when ``shape`` is too small for ``model``'s feature levels."""
    least = SIDE_MULTIPLE * smallest_multiple(model)
    if min(shape.height, shape.width) < least:
        raise ValueError(f"image_size must be at least {least} x {least} for this model (its smallest feature level "
                         f"needs 2 pixels a side), got {shape.height} x {shape.width}")


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
    """torch.export of ``detector`` on ``inputs`` (its sample batch), with dynamic batch and sides or fixed at
    the sample's shape."""
    images = inputs[0]
    shape = SampleShape(batch=images.shape[0], height=images.shape[2], width=images.shape[3])
    check_sample_shape(shape, detector.model)
    shapes = dynamic_shapes(detector) if dynamic else None
    with torch.no_grad():
        return torch.export.export(for_tracing(detector).eval(), inputs, dynamic_shapes=shapes)
