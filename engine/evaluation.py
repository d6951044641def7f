"""Inference over a validation loader and COCO bbox AP, gathered over ranks, written as json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from datasets import CocoEvaluator

from .precision import Precision
from .rng import rng_preserved


@torch.no_grad()
@rng_preserved()
def evaluate_coco(*, model: torch.nn.Module, postprocess, loader, coco_gt, device: torch.device,
                  precision: Precision) -> tuple[dict[str, float], int]:
    """(COCO bbox AP/AP50/AP75/APs/APm/APl, number of images scored) of ``model`` on ``loader``.

    The same on every rank.
    ``model`` is the unwrapped module (not DDP: inference needs no gradient sync). Each rank runs its
    share of the images; the evaluator gathers detections from all ranks before scoring. The random
    generators are left as they were (engine.rng.rng_preserved).
    """
    was_training = model.training
    model.eval()
    evaluator = CocoEvaluator(coco_gt)
    for images, masks, targets in loader:
        images = images.to(device, non_blocking=True)
        masks = masks.to(device, non_blocking=True)
        with precision.autocast():
            outputs = model(images, masks)
        orig_sizes = torch.stack([t["orig_size"] for t in targets]).to(device)  # (B, 2) (h, w)
        # Boxes and scores in fp32 whatever autocast produced: COCO matching compares IoUs to 0.05 steps.
        outputs = {k: v.float() for k, v in outputs.items() if k in ("pred_logits", "pred_boxes")}
        results = postprocess(outputs, orig_sizes)
        evaluator.update({int(t["image_id"]): r for t, r in zip(targets, results)})
    stats = evaluator.summarize()  # gathers every rank's detections first
    model.train(was_training)
    return stats, len(evaluator.results)


def write_eval_json(path: str | Path, *, stats: dict[str, float], **info) -> Path:
    """``{**info, **stats}`` as json, written atomically (rank 0 only)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump({**info, **stats}, f, indent=2)
    os.replace(tmp, path)
    return path
