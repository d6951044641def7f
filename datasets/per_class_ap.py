"""AP per category from a finished COCOeval, named as in the annotation file.

COCOeval.accumulate() leaves ``eval["precision"]`` of shape (T, R, K, A, M): T IoU thresholds (.50:.05:.95),
R recall thresholds (101 points), K categories in ``params.catIds`` order, A area ranges (all, small,
medium, large), M detection limits (1, 10, 100); -1 where a category has no ground truth. COCO's summary AP
(stats[0]) is the mean over T, R and K of the entries > -1 at area "all" and 100 detections, so the AP of one
category is the same mean with K fixed: the per-class figures average to the summary AP.

faster-coco-eval's COCOeval (datasets/cocoeval_backend.py) leaves the same array, shape and order (its C++
accumulate follows pycocotools'), and the same ``params``; its ``catIds`` are numpy integers, read as ints here.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from pycocotools.coco import COCO


def category_names(coco_gt: COCO, category_ids) -> dict[int, str]:
    """category id -> its name in the annotation file; a name used by several ids gets " (id N)" added."""
    names = {int(i): str(coco_gt.cats[i].get("name", i)) for i in category_ids}
    repeated = {name for name, count in Counter(names.values()).items() if count > 1}
    return {i: f"{name} (id {i})" if name in repeated else name for i, name in names.items()}


def per_class_ap(coco_eval) -> dict[str, float | None]:
    """{category name: AP at IoU .50:.95, all areas, 100 detections}, in category id order.

    ``coco_eval``: pycocotools' COCOeval or faster-coco-eval's (the module docstring).

    None for a category without ground truth in the evaluated images (COCO defines no AP there, and its
    summary leaves it out). Call after ``evaluate()`` and ``accumulate()``.
    """
    params = coco_eval.params
    precision = coco_eval.eval["precision"]  # (T, R, K, A, M)
    area = list(params.areaRngLbl).index("all")
    max_dets = len(params.maxDets) - 1  # 100, the limit of the summary AP
    names = category_names(coco_eval.cocoGt, params.catIds)
    result = {}
    for k, category_id in enumerate(params.catIds):
        values = precision[:, :, k, area, max_dets]  # (T, R)
        defined = values[values > -1]
        result[names[int(category_id)]] = float(np.mean(defined)) if defined.size else None
    return result


def per_class_without_detections(coco_gt: COCO, image_ids) -> dict[str, float | None]:
    """Per-class AP when nothing was detected: 0 where the images hold ground truth, None elsewhere.

    Ground truth counts as COCOeval counts it: crowd boxes are ignored.
    """
    present = {
        a["category_id"] for a in coco_gt.loadAnns(coco_gt.getAnnIds(imgIds=list(image_ids))) if not a.get("iscrowd", 0)
    }
    category_ids = sorted(coco_gt.getCatIds())
    names = category_names(coco_gt, category_ids)
    return {names[i]: (0.0 if i in present else None) for i in category_ids}
