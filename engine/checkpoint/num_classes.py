"""How many classes the model predicts, and whether the data's category ids fit in them: class c is category id c
(91 outputs for COCO's ids up to 90), so a larger id would fail inside the matcher or never be detected."""

from __future__ import annotations

import logging
import re

from datasets import CocoDetection
from datasets.annotations import largest_annotated_category, max_category_id

log = logging.getLogger(__name__)

_CLASS_HEAD = re.compile(r"(module\.)?class_embed(\.0)?\.weight")


def classes_in_weights(state: dict) -> int | None:
    """Rows of the class head in a state_dict (ours or an official one), or None without one."""
    for key, value in state.items():
        if _CLASS_HEAD.fullmatch(key):
            return int(value.shape[0])
    return None


def resolve_num_classes(
    num_classes: int | None,
    datasets: dict[str, CocoDetection],
    *,
    evaluated: str | None = None,
    resumed_from: str | None = None,
) -> int:
    """``num_classes`` (None: the training annotations' largest category id plus one, logged). ValueError naming the
    file, the id, an annotation and a fix when a split's category id does not fit; ``evaluated``: the checkpoint an
    evaluation scores, whose class head has ``num_classes`` rows; ``resumed_from``: the checkpoint a resumed run,
    whose model keeps its classes, came from."""
    evaluating, resumed = evaluated is not None, resumed_from is not None and num_classes is not None
    source = f"model.num_classes={num_classes}"
    if resumed:
        source = f"the model resumed from {resumed_from} ({num_classes} classes)"
    if evaluating:
        source = f"the checkpoint's class head ({num_classes} classes)"

    def fix(needed: int) -> str:
        if evaluating:
            return (
                f"this checkpoint was trained for other category ids, and a checkpoint is evaluated with the "
                f"classes it was trained for (model.num_classes does not change them): evaluate it on data with "
                f"its categories, or train a model for this data from its weights first (python train.py "
                f"model.init_from={evaluated or 'CHECKPOINT'} with this data's dataset settings: the class head "
                f"starts afresh for its ids) and evaluate that run's checkpoint"
            )
        if resumed:
            return (
                f"a resumed model keeps its classes: fix the data, or start a new run from that checkpoint with "
                f"model.init_from={resumed_from} model.num_classes={needed} (resume=null)"
            )
        return f"set model.num_classes={needed} or more (model.num_classes=null takes it from the training annotations)"

    if num_classes is None:
        train = datasets.get("train")
        largest = max_category_id(train.coco.dataset) if train is not None else None
        if largest is None:
            raise ValueError(
                "model.num_classes is null, and there are no training annotations to take it from: "
                "set model.num_classes"
            )
        num_classes = largest + 1
        source = f"model.num_classes=null, so {num_classes},"
        log.info(
            "model.num_classes=null: using %d, the largest category id in %s (%d) plus one",
            num_classes,
            train.annotation_file,
            largest,
        )
    for split, dataset in datasets.items():
        largest = largest_annotated_category(dataset.coco.dataset)
        if largest is not None and largest[0] >= num_classes:
            category_id, ann_id = largest
            raise ValueError(
                f"{dataset.annotation_file} ({split}) has category id {category_id} (e.g. annotation id {ann_id}), "
                f"but {source} covers ids 0..{num_classes - 1} only: " + fix(category_id + 1)
            )
    return num_classes
