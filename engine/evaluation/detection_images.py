"""Validation images with their detections and ground truth drawn into TensorBoard after each evaluation: the
same few images every time, one tag each, so the image slider shows the detector improving. Drawn from the
detections the evaluation already holds, on rank 0 only."""

from __future__ import annotations

import math

import torch
from torchvision.ops import box_convert
from torchvision.transforms.v2 import functional as F
from torchvision.utils import draw_bounding_boxes

from datasets.per_class_ap import category_names

from .label_font import SIZE, label_font

GROUND_TRUTH_COLOUR = (0, 230, 0)
DETECTION_COLOUR = (255, 90, 0)
# Pictures are scaled so their long side lies in [MIN_SIDE, MAX_SIDE]: small images (the synthetic set) get
# readable labels, large photos do not bloat the event file.
MIN_SIDE, MAX_SIDE = 384, 800
TAG = "eval_images"


def pick_image_ids(coco_gt, count: int) -> list[int]:
    """``count`` image ids spread evenly over the sorted ids of the images holding (non-crowd) ground truth, or
    of all images when none does: the annotation file alone decides."""
    ids = sorted(coco_gt.imgs)
    pool = [i for i in ids if any(not a.get("iscrowd", 0) for a in coco_gt.imgToAnns.get(i, []))] or ids
    count = min(count, len(pool))
    return [pool[(k * len(pool)) // count] for k in range(count)]


def display_scale(*, height: int, width: int) -> float:
    """Factor that brings the long side into [MIN_SIDE, MAX_SIDE] (an integer when enlarging)."""
    long_side = max(height, width)
    if long_side < MIN_SIDE:
        return float(math.ceil(MIN_SIDE / long_side))
    if long_side > MAX_SIDE:
        return MAX_SIDE / long_side
    return 1.0


def draw_detections(
    image: torch.Tensor, *, ground_truth: torch.Tensor, boxes: torch.Tensor, labels: list[str]
) -> torch.Tensor:
    """(3, H, W) uint8 with ground truth (g, 4) in green, then detections (d, 4) with ``labels`` on top; xyxy pixels."""
    if len(ground_truth):
        image = draw_bounding_boxes(image, ground_truth, colors=GROUND_TRUTH_COLOUR, width=2)
    if len(boxes):
        font = label_font()
        image = draw_bounding_boxes(
            image,
            boxes,
            labels=labels,
            colors=DETECTION_COLOUR,
            width=2,
            fill_labels=True,
            font=font.path,
            font_size=SIZE if font.path else None,
        )
    return image


class DetectionImages:
    """Draws ``num_images`` fixed validation images of ``dataset`` (a CocoDetection) with detections >= ``min_score``.

    ``render(detections)`` -> {image id: (3, H, W) uint8}; ``write`` adds them to TensorBoard as
    ``eval_images/image_id_<id>``. ``detections``: image id -> COCO results (Evaluation.detections)."""

    def __init__(self, *, dataset, num_images: int, min_score: float):
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 0:
            raise ValueError(f"DetectionImages: num_images must be an integer >= 0, got {num_images!r}")
        if isinstance(min_score, bool) or not isinstance(min_score, (int, float)) or not 0 <= min_score <= 1:
            raise ValueError(f"DetectionImages: min_score must be a number in [0, 1], got {min_score!r}")
        self.dataset = dataset
        self.min_score = float(min_score)
        self.image_ids = pick_image_ids(dataset.coco, num_images) if num_images else []
        self.names = category_names(dataset.coco, dataset.coco.getCatIds())
        self._pictures: dict[int, tuple[torch.Tensor, float]] = {}  # image id -> (scaled image, scale)

    def _picture(self, image_id: int) -> tuple[torch.Tensor, float]:
        """The image file at display size, read once: the same pixels at every evaluation."""
        if image_id not in self._pictures:
            image = self.dataset.load_image(image_id).as_subclass(torch.Tensor)  # (3, H, W) uint8
            height, width = image.shape[-2:]
            scale = display_scale(height=height, width=width)
            if scale != 1.0:
                image = F.resize(image, [round(height * scale), round(width * scale)], antialias=True)
            self._pictures[image_id] = (image, scale)
        return self._pictures[image_id]

    def render(self, detections: dict[int, list[dict]]) -> dict[int, torch.Tensor]:
        pictures = {}
        for image_id in self.image_ids:
            image, scale = self._picture(image_id)
            anns = [a for a in self.dataset.coco.imgToAnns.get(image_id, []) if not a.get("iscrowd", 0)]
            kept = [d for d in detections.get(image_id, []) if d["score"] >= self.min_score]
            font = label_font()
            labels = [
                f"{font.label(self.names.get(d['category_id'], str(d['category_id'])), d['category_id'])} "
                f"{d['score']:.2f}"
                for d in kept
            ]
            pictures[image_id] = draw_detections(
                image,
                ground_truth=_xyxy([a["bbox"] for a in anns], scale),
                boxes=_xyxy([d["bbox"] for d in kept], scale),
                labels=labels,
            )
        return pictures

    def write(self, writer, detections: dict[int, list[dict]], step: int) -> None:
        for image_id, picture in self.render(detections).items():
            writer.add_image(f"{TAG}/image_id_{image_id}", picture, step)


def _xyxy(xywh: list, scale: float) -> torch.Tensor:
    """COCO boxes [[x, y, w, h]] -> (n, 4) xyxy float scaled to the displayed picture."""
    boxes = torch.tensor(xywh, dtype=torch.float32).reshape(-1, 4)  # (n, 4) xywh
    return box_convert(boxes, "xywh", "xyxy") * scale


def build_detection_images(cfg, dataset, *, enabled: bool) -> DetectionImages:
    """From the run settings ``eval_images`` and ``eval_images_min_score``; nothing drawn unless ``enabled``."""
    return DetectionImages(
        dataset=dataset, num_images=cfg.eval_images if enabled else 0, min_score=cfg.eval_images_min_score
    )
