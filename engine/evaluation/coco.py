"""Inference over a validation loader and COCO bbox AP, gathered over ranks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch._dynamo

from datasets import CocoEvaluator
from datasets.cocoeval_backend import PACKAGES
from engine.reporting.cocoeval_log import log_cocoeval_output
from engine.reporting.progress import EvaluationProgress
from engine.runtime.distributed import Ranks
from engine.runtime.precision import Precision
from engine.runtime.rng import rng_preserved

log = logging.getLogger(__name__)
# Seconds between evaluation progress lines.
PROGRESS_EVERY_S = 15.0


class EvaluationStopped(Exception):
    """An evaluation left between two batches, as its ``should_stop`` asked."""


@dataclass(frozen=True)
class Evaluation:
    """One pass over the validation set; all but ``detections`` and the timings the same on every rank."""

    stats: dict[str, float]  # "AP", "AP50", "AP75", "APs", "APm", "APl" (COCOeval stats[0..5])
    per_class: dict[str, float | None]  # category name -> AP (IoU .50:.95), None where the images hold none; id order
    num_images: int  # images scored
    # image id -> [{"image_id", "category_id", "bbox" xywh in the file's pixels, "score"}], only for the images of
    # ``keep_detections`` (all of them would be too many)
    detections: dict[int, list[dict]]
    inference_s: float  # this process's wall time of its pass (compilation included)
    cocoeval_s: float  # this process's wall time from the end of its pass to the figures (gather, COCOeval, broadcast)
    cocoeval_backend: str  # the COCOeval that ran: "faster" (faster-coco-eval) or "pycocotools"


@torch.no_grad()
@rng_preserved()
def evaluate_coco(
    *,
    model: torch.nn.Module,
    postprocess,
    loader,
    coco_gt,
    device: torch.device,
    precision: Precision,
    keep_detections: Iterable[int] = (),
    ranks: Ranks | None = None,
    compiled: bool = False,
    backend: str = "auto",
    progress_every_s: float = PROGRESS_EVERY_S,
    should_stop=None,
) -> Evaluation:
    """COCO bbox AP of ``model`` on ``loader`` (see Evaluation), with the detections of the ``keep_detections``
    image ids; the random generators are left as they were. ``backend``: datasets.cocoeval_backend's choices.

    ``model`` (the unwrapped DeformableDETR) runs ``detect`` compiled with ``compiled``, else with Dynamo off, so that
    no compiled training region compiles again without gradients. Each rank infers its share; the evaluator gathers
    every rank's detections before scoring. ``should_stop(final)`` is asked after each batch (False) and after the
    last (True, before the gather): True raises EvaluationStopped. Every rank must answer the final question alike."""
    was_training = model.training
    model.eval()
    evaluator = CocoEvaluator(coco_gt, ranks=ranks, backend=backend)  # an unknown backend fails before inference
    is_main = ranks is None or ranks.is_main
    world_size = 1 if ranks is None else ranks.ctx.world_size
    try:
        total = len(loader.dataset)
    except (AttributeError, TypeError):  # a loader without a sized dataset
        total = None
    share = None if total is None else -(-total // world_size)  # as the evaluation sampler splits them
    progress = EvaluationProgress(
        total_images=share, every_s=progress_every_s, enabled=is_main, share_of=total if world_size > 1 else None
    )
    started = time.perf_counter()
    stopped = False
    for images, masks, targets in loader:
        with precision.autocast(), torch._dynamo.config.patch(disable=not compiled):
            outputs = model.detect(images.to(device, non_blocking=True), masks.to(device, non_blocking=True))
        orig_sizes = torch.stack([t["orig_size"] for t in targets]).to(device)  # (B, 2) (h, w)
        # Boxes and scores in fp32 whatever autocast produced: COCO matching compares IoUs to 0.05 steps.
        outputs = {k: v.float() for k, v in outputs.items() if k in ("pred_logits", "pred_boxes")}
        results = postprocess(outputs, orig_sizes)
        evaluator.update({int(t["image_id"]): r for t, r in zip(targets, results)})  # reads them to the host
        progress.update(len(evaluator.results))  # the distinct images done: batch-filling copies count once
        stopped = should_stop is not None and should_stop(False)
        if stopped:
            break
    if should_stop is not None and (stopped or should_stop(True)):  # after a batch, or after the last
        model.train(was_training)
        raise EvaluationStopped(f"evaluation stopped after {len(evaluator.results)} images")
    inferred = time.perf_counter()
    try:
        stats = evaluator.summarize()  # gathers every rank's detections first
    finally:  # what COCOeval printed reaches train.log also when it fails
        if is_main:
            log_cocoeval_output(evaluator.cocoeval_output, log)
    inference_s, cocoeval_s = inferred - started, time.perf_counter() - inferred
    model.train(was_training)
    num_images = len(evaluator.results)
    if is_main:
        if not evaluator.num_detections:
            log.warning("evaluation: no detections on any of the %d images; every AP is 0", num_images)
        log.info(
            "evaluation of %d images: inference %.1f s (%.1f img/s), COCOeval %.1f s (%s)",
            num_images,
            inference_s,
            num_images / max(inference_s, 1e-9),
            cocoeval_s,
            PACKAGES[evaluator.backend],
        )
    kept = {int(i): evaluator.results[int(i)] for i in keep_detections if int(i) in evaluator.results}
    return Evaluation(
        stats=stats,
        per_class=evaluator.per_class,
        num_images=num_images,
        detections=kept,
        inference_s=inference_s,
        cocoeval_s=cocoeval_s,
        cocoeval_backend=evaluator.backend,
    )
