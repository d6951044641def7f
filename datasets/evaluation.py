"""COCO box AP with COCOeval (faster-coco-eval's or pycocotools', datasets/cocoeval_backend.py), gathered over
distributed ranks."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Protocol

import torch
from pycocotools.coco import COCO
from torchvision.ops import box_convert

from .cocoeval_backend import evaluated_cocoeval, resolve_backend
from .json_file import write_json
from .per_class_ap import per_class_ap, per_class_without_detections

# Names of COCOeval.stats[0..5] (bbox): AP at IoU .50:.95, .50, .75, then by object area.
STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl")


class RankExchange(Protocol):
    """What the evaluator needs from a multi-process run (engine.runtime.distributed.Ranks provides it)."""

    is_main: bool

    def all_gather_object(self, obj) -> list: ...

    def broadcast_object(self, obj): ...


def coco_results(image_id: int, prediction: dict[str, torch.Tensor]) -> list[dict]:
    """One image's detections {"scores" (k,), "labels" (k,), "boxes" (k, 4) xyxy} as COCO results:
    [{"image_id", "category_id", "bbox" [x, y, w, h], "score"}]."""
    boxes = box_convert(prediction["boxes"].detach().float().cpu(), "xyxy", "xywh").tolist()  # COCO's format
    scores = prediction["scores"].detach().float().cpu().tolist()
    labels = prediction["labels"].detach().cpu().tolist()
    return [
        {"image_id": int(image_id), "category_id": int(label), "bbox": box, "score": score}
        for box, score, label in zip(boxes, scores, labels)
    ]


class CocoEvaluator:
    """Collects detections, then computes COCO bbox AP against ``coco_gt``.

    Usage on every rank::

        evaluator = CocoEvaluator(coco_gt=dataset.coco, ranks=ranks)   # ranks: None for one process
        evaluator.update({image_id: {"scores": (k,), "labels": (k,), "boxes": (k, 4)}})  # per batch
        stats = evaluator.summarize()   # gathers, evaluates on rank 0, broadcasts; same dict everywhere
        evaluator.per_class             # {category name: AP or None}, from the same COCOeval run
        evaluator.cocoeval_output       # what COCOeval printed (rank 0), for the caller to log

    ``boxes`` are xyxy in absolute pixels of the original image (PostProcess with target_sizes =
    orig_size); ``labels`` are COCO category ids. Every updated image id counts in the evaluation,
    also with no detections (its ground truth then counts as missed).

    ``backend``: "auto" (faster-coco-eval when installed, else pycocotools), "faster" or "pycocotools"
    (datasets.cocoeval_backend.resolve_backend); ``self.backend`` is the one that runs. An unknown name, or
    "faster" without the package, is a ValueError here rather than after a whole pass of inference.
    """

    def __init__(self, coco_gt: COCO, *, ranks: RankExchange | None = None, backend: str = "auto") -> None:
        self.coco_gt = coco_gt
        self.ranks = ranks
        self.backend = resolve_backend(backend)
        # COCOeval's printing (progress lines and the summary table) of the last summarize(), captured so that
        # the caller decides where it goes (train.py: the table to the console, the rest to train.log only).
        self.cocoeval_output = ""
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
            self.results[image_id] = coco_results(image_id, prediction)
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
    def num_detections(self) -> int:
        return sum(len(detections) for detections in self.results.values())

    @property
    def detections(self) -> list[dict]:
        """All detections in COCO results format (bbox xywh), ordered by image id."""
        return [d for image_id in sorted(self.results) for d in self.results[image_id]]

    def summarize(self) -> dict[str, float]:
        """{"AP", "AP50", "AP75", "APs", "APm", "APl"}: COCOeval stats[0..5], the same on every rank.

        Prints nothing: what COCOeval prints on rank 0 is kept in ``self.cocoeval_output``. With no detections
        at all every figure is 0.0 and COCOeval does not run (pycocotools' loadRes cannot take an empty list).
        Figures are -1.0 where COCO defines none (e.g. APs when no ground-truth box is small). Also sets
        ``self.per_class`` (see :func:`datasets.per_class_ap.per_class_ap`), computed from the same COCOeval run.
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
        self.cocoeval_output = ""
        if not detections:
            return (
                {name: 0.0 for name in STAT_NAMES},
                per_class_without_detections(self.coco_gt, sorted(self.results)),
            )
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                # Only the images that were evaluated: a partial pass (max_steps, a subset) is not scored
                # against ground truth it never saw.
                coco_eval = evaluated_cocoeval(self.coco_gt, detections, image_ids=self.results, backend=self.backend)
        finally:  # kept on failure too: the lines before it say how far COCOeval got
            self.cocoeval_output = printed.getvalue()
        stats = {name: float(coco_eval.stats[i]) for i, name in enumerate(STAT_NAMES)}
        return stats, per_class_ap(coco_eval)

    def save_detections(self, path: str | Path) -> None:
        """Write the detections as a COCO results json (list of {image_id, category_id, bbox xywh, score}).

        Call after :meth:`summarize` (or :meth:`gather`) and on one rank only; written atomically.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, self.detections)
