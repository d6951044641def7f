"""A run's evaluation on its validation set, evaluated and recorded by one call: training after its epochs and
``eval_only=true`` both evaluate through ``Validation.run``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.runtime.distributed import Ranks
from engine.runtime.precision import Precision

from .coco import Evaluation, evaluate_coco
from .detection_images import DetectionImages
from .record import record_evaluation

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

    def run(self, *, writer, json_path: str | Path, step: int, what: str, should_stop=None, record: bool = True,
            **info) -> Evaluation:
        """Evaluate, then on rank 0 with ``record``, record_evaluation; ``should_stop`` as evaluate_coco takes it."""
        evaluation = evaluate_coco(model=self.model, postprocess=self.postprocess, loader=self.loader,
                                   coco_gt=self.coco_gt, device=self.ranks.ctx.device, precision=self.precision,
                                   keep_detections=self.detection_images.image_ids, ranks=self.ranks,
                                   compiled=self.compiled, backend=self.backend, should_stop=should_stop)
        if record and self.ranks.is_main:
            record_evaluation(evaluation, writer=writer, json_path=json_path, step=step, what=what,
                              detection_images=self.detection_images, log=log, **info)
        return evaluation
