"""Inference over a validation loader and COCO bbox AP, gathered over ranks, written as json."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo

from datasets import CocoEvaluator

from .distributed import Ranks
from .per_class_report import report_per_class
from .precision import Precision
from .rng import rng_preserved


@dataclass(frozen=True)
class Evaluation:
    """What one pass over the validation set gives; all but ``detections`` the same on every rank.

    stats       {"AP", "AP50", "AP75", "APs", "APm", "APl"} (COCOeval stats[0..5])
    per_class   {category name: AP (IoU .50:.95) or None where the images hold none}, category id order,
                from the same COCOeval run as ``stats``
    num_images  images scored
    detections  image id -> [{"image_id", "category_id", "bbox" xywh in the file's pixels, "score"}], for the
                images asked for with ``keep_detections`` only (all of COCO val's would hold ~0.5M dicts per rank)
    """

    stats: dict[str, float]
    per_class: dict[str, float | None]
    num_images: int
    detections: dict[int, list[dict]]


@torch.no_grad()
@rng_preserved()
def evaluate_coco(*, model: torch.nn.Module, postprocess, loader, coco_gt, device: torch.device,
                  precision: Precision, keep_detections: Iterable[int] = (), ranks: Ranks | None = None,
                  compiled: bool = False) -> Evaluation:
    """COCO bbox AP of ``model`` on ``loader``: summary, per class, and the detections (see Evaluation).

    The figures are the same on every rank; ``keep_detections`` (image ids, e.g. those drawn in TensorBoard)
    picks the detections returned.
    ``model`` is the unwrapped DeformableDETR (not DDP: inference needs no gradient sync), run through its
    ``detect``: its compiled evaluation graph with ``compiled``, else eagerly, with Dynamo off so that no
    compiled training region compiles again without gradients. Each rank runs its share of the images; the
    evaluator gathers detections from all ranks (``ranks``) before scoring. The random generators are left as
    they were (engine.rng.rng_preserved).
    """
    was_training = model.training
    model.eval()
    evaluator = CocoEvaluator(coco_gt, ranks=ranks)
    for images, masks, targets in loader:
        images = images.to(device, non_blocking=True)
        masks = masks.to(device, non_blocking=True)
        with precision.autocast(), torch._dynamo.config.patch(disable=not compiled):
            outputs = model.detect(images, masks)
        orig_sizes = torch.stack([t["orig_size"] for t in targets]).to(device)  # (B, 2) (h, w)
        # Boxes and scores in fp32 whatever autocast produced: COCO matching compares IoUs to 0.05 steps.
        outputs = {k: v.float() for k, v in outputs.items() if k in ("pred_logits", "pred_boxes")}
        results = postprocess(outputs, orig_sizes)
        evaluator.update({int(t["image_id"]): r for t, r in zip(targets, results)})
    stats = evaluator.summarize()  # gathers every rank's detections first
    model.train(was_training)
    kept = {int(i): evaluator.results[int(i)] for i in keep_detections if int(i) in evaluator.results}
    return Evaluation(stats=stats, per_class=evaluator.per_class, num_images=len(evaluator.results),
                      detections=kept)


def write_eval_json(path: str | Path, *, stats: dict[str, float], per_class: dict[str, float | None] | None = None,
                    **info) -> Path:
    """``{**info, **stats, "per_class": per_class}`` as json, written atomically (rank 0 only).

    ``per_class`` is {category name: AP}, null for a category without ground truth in the evaluated images.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    record = {**info, **stats}
    if per_class is not None:
        record["per_class"] = per_class
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, path)
    return path


def record_evaluation(evaluation: Evaluation, *, writer, json_path: str | Path, step: int, what: str,
                      detection_images, log: logging.Logger, **info) -> None:
    """Rank 0: an evaluation into TensorBoard (eval/*, eval_per_class/*, the pictures), ``json_path`` (with
    ``info``) and the log ("evaluation <what> (N images): AP ..." and the per-class table)."""
    writer.add("eval", evaluation.stats, step)
    write_eval_json(json_path, stats=evaluation.stats, step=step, num_images=evaluation.num_images,
                    per_class=evaluation.per_class, **info)
    log.info("evaluation %s (%d images): %s", what, evaluation.num_images,
             " ".join(f"{k} {v:.4f}" for k, v in evaluation.stats.items()))
    report_per_class(evaluation.per_class, writer=writer, step=step, log=log)
    detection_images.write(writer, evaluation.detections, step)

