"""A run's evaluation on its validation set, evaluated and recorded by one call: training after its epochs and
``eval_only=true`` both evaluate through ``Validation.run``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.reporting.per_class import report_per_class
from engine.runtime.distributed import Ranks
from engine.runtime.precision import Precision

from .coco import Evaluation, evaluate_coco
from .detection_images import DetectionImages
from .record import write_eval_json

log = logging.getLogger(__name__)


@dataclass
class Validation:
    """What an evaluation of this run needs, fixed for the run (evaluate_coco says what each is)."""

    model: torch.nn.Module
    postprocess: torch.nn.Module
    loader: object
    coco_gt: object
    precision: Precision
    ranks: Ranks
    compiled: bool
    backend: str
    detection_images: DetectionImages

    def run(
        self, *, writer, json_path: str | Path, step: int, what: str, should_stop=None, record: bool = True, **info
    ) -> Evaluation:
        """Evaluate (``should_stop`` as evaluate_coco takes it); then on rank 0, with ``record``, record it in
        TensorBoard, ``json_path`` (with ``info``) and the log."""
        evaluation = evaluate_coco(
            model=self.model,
            postprocess=self.postprocess,
            loader=self.loader,
            coco_gt=self.coco_gt,
            device=self.ranks.ctx.device,
            precision=self.precision,
            keep_detections=self.detection_images.image_ids,
            ranks=self.ranks,
            compiled=self.compiled,
            backend=self.backend,
            should_stop=should_stop,
        )
        if record and self.ranks.is_main:
            writer.add("eval", evaluation.stats, step)
            write_eval_json(
                json_path,
                stats=evaluation.stats,
                step=step,
                num_images=evaluation.num_images,
                per_class=evaluation.per_class,
                **info,
            )
            log.info(
                "evaluation %s (%d images): %s",
                what,
                evaluation.num_images,
                " ".join(f"{k} {v:.4f}" for k, v in evaluation.stats.items()),
            )
            report_per_class(evaluation.per_class, writer=writer, step=step, log=log)
            self.detection_images.write(writer, evaluation.detections, step)
        return evaluation
