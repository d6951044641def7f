"""Per-class AP of an evaluation in the log (a table) and in TensorBoard (``eval_per_class/<name>``), rank 0."""

from __future__ import annotations

import logging

TAG = "eval_per_class"


def format_per_class_table(per_class: dict[str, float | None]) -> str:
    """Lines "name  AP", in the order given (category id order); "-" where no ground truth was evaluated."""
    width = max([len("category"), *(len(name) for name in per_class)])
    rows = [f"{name:<{width}}  {'-' if ap is None else f'{ap:.4f}'}" for name, ap in per_class.items()]
    return "\n".join([f"{'category':<{width}}  AP (IoU .50:.95)", *rows])


def report_per_class(per_class: dict[str, float | None], *, writer, step: int, log: logging.Logger) -> None:
    """Log the table and add ``eval_per_class/<category name>`` scalars (categories without an AP are left out)."""
    if not per_class:
        return
    log.info("AP per category:\n%s", format_per_class_table(per_class))
    writer.add(TAG, {name: ap for name, ap in per_class.items() if ap is not None}, step)
