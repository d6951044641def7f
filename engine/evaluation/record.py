"""An evaluation's figures recorded: eval json, TensorBoard (scalars, per-class AP, pictures) and the log."""

from __future__ import annotations

import logging
from pathlib import Path

from datasets.json_file import write_json
from engine.reporting.per_class import report_per_class

from .coco import Evaluation


def write_eval_json(path: str | Path, *, stats: dict[str, float], per_class: dict[str, float | None] | None = None,
                    **info) -> Path:
    """``{**info, **stats, "per_class": per_class}`` as json, written atomically (rank 0 only); ``per_class``
    {category name: AP}, null for a category without ground truth in the evaluated images."""
    record = {**info, **stats}
    if per_class is not None:
        record["per_class"] = per_class
    return write_json(path, record, indent=2)


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
