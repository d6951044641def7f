"""An evaluation's figures as eval json."""

from __future__ import annotations

from pathlib import Path

from datasets.json_file import write_json


def write_eval_json(
    path: str | Path, *, stats: dict[str, float], per_class: dict[str, float | None] | None = None, **info
) -> Path:
    """``{**info, **stats, "per_class": per_class}`` as json, written atomically (rank 0 only); ``per_class``
    {category name: AP}, null for a category without ground truth in the evaluated images."""
    record = {**info, **stats}
    if per_class is not None:
        record["per_class"] = per_class
    return write_json(path, record, indent=2)
