"""COCO box AP with pycocotools' COCOeval, gathered over distributed ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torchvision.ops import box_convert

from .per_class_ap import per_class_ap, per_class_without_detections

# Names of COCOeval.stats[0..5] (bbox): AP at IoU .50:.95, .50, .75, then by object area.
STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl")


class RankExchange(Protocol):
    """What the evaluator needs from a multi-process run (engine.distributed.Ranks provides it)."""

    is_main: bool

    def all_gather_object(self, obj) -> list: ...

    def broadcast_object(self, obj): ...


class CocoEvaluator:
    """Collects detections, then computes COCO bbox AP against ``coco_gt``.

    Usage on every rank::

        evaluator = CocoEvaluator(coco_gt=dataset.coco, ranks=ranks)   # ranks: None for one process
        evaluator.update({image_id: {"scores": (k,), "labels": (k,), "boxes": (k, 4)}})  # per batch
        stats = evaluator.summarize()   # gathers, evaluates on rank 0, broadcasts; same dict everywhere
        evaluator.per_class             # {category name: AP or None}, from the same COCOeval run

    ``boxes`` are xyxy in absolute pixels of the original image (PostProcess with target_sizes =
    orig_size); ``labels`` are COCO category ids. Every updated image id counts in the evaluation,
    also with no detections (its ground truth then counts as missed).
    """

    def __init__(self, coco_gt: COCO, *, ranks: "RankExchange | None" = None) -> None:
        self.coco_gt = coco_gt
        self.ranks = ranks
        # image id -> COCO result dicts; keyed by image so that repeats (DistributedSampler pads the
        # last batch with images other ranks also see) are counted once: a repeat replaces.
        self.results: dict[int, list[dict]] = {}
        self.stats: dict[str, float] | None = None
        self.per_class: dict[str, float | None] | None = None
        self._gathered = False

    def update(self, predictions: dict[int, dict[str, torch.Tensor]]) -> None:
        """Add detections of some images: image_id -> {"scores" (k,), "labels" (k,), "boxes" (k, 4) xyxy}."""
        for image_id, prediction in predictions.items():
            image_id = int(image_id)
            if image_id not in self.coco_gt.imgs:
                raise KeyError(f"image id {image_id} is not in the ground-truth annotations")
            boxes = box_convert(prediction["boxes"].detach().float().cpu(), "xyxy", "xywh").tolist()  # COCO's format
            scores = prediction["scores"].detach().float().cpu().tolist()
            labels = prediction["labels"].detach().cpu().tolist()
            self.results[image_id] = [
                {"image_id": image_id, "category_id": int(label), "bbox": box, "score": score}
                for box, score, label in zip(boxes, scores, labels)
            ]
        self._gathered = False

    def gather(self) -> None:
        """Merge every rank's detections into every rank (no-op for one process)."""
        if self._gathered:
            return
        if self.ranks is not None:
            parts = self.ranks.all_gather_object(self.results)
            merged: dict[int, list[dict]] = {}
            for part in parts:
                for image_id, detections in part.items():
                    merged.setdefault(image_id, detections)
            self.results = merged
        self._gathered = True

    @property
    def detections(self) -> list[dict]:
        """All detections in COCO results format (bbox xywh), ordered by image id."""
        return [d for image_id in sorted(self.results) for d in self.results[image_id]]

    def summarize(self) -> dict[str, float]:
        """{"AP", "AP50", "AP75", "APs", "APm", "APl"}: COCOeval stats[0..5], the same on every rank.

        Prints pycocotools' summary table on rank 0. With no detections at all every figure is 0.0
        (pycocotools' loadRes cannot take an empty list). Figures are -1.0 where COCO defines none
        (e.g. APs when no ground-truth box is small). Also sets ``self.per_class`` (see
        :func:`datasets.per_class_ap.per_class_ap`), computed from the same COCOeval run.
        """
        self.gather()
        stats = per_class = None
        if self.ranks is None or self.ranks.is_main:
            stats, per_class = self._evaluate()
        if self.ranks is not None:
            stats, per_class = self.ranks.broadcast_object((stats, per_class))
        self.stats, self.per_class = stats, per_class
        return stats

    def _evaluate(self) -> tuple[dict[str, float], dict[str, float | None]]:
        detections = self.detections
        if not detections:
            print(f"COCO bbox evaluation: no detections on {len(self.results)} images; AP = 0")
            return ({name: 0.0 for name in STAT_NAMES},
                    per_class_without_detections(self.coco_gt, sorted(self.results)))
        coco_dt = self.coco_gt.loadRes(detections)
        coco_eval = COCOeval(self.coco_gt, coco_dt, iouType="bbox")
        # Only the images that were evaluated: a partial pass (max_steps, a subset) is not scored
        # against ground truth it never saw.
        coco_eval.params.imgIds = sorted(self.results)
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
        stats = {name: float(coco_eval.stats[i]) for i, name in enumerate(STAT_NAMES)}
        return stats, per_class_ap(coco_eval)

    def save_detections(self, path: str | Path) -> None:
        """Write the detections as a COCO results json (list of {image_id, category_id, bbox xywh, score}).

        Call after :meth:`summarize` (or :meth:`gather`) and on one rank only; written atomically.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.detections, f)
        os.replace(tmp, path)
