"""Reading a COCO-format annotation file, and checking it once before any training starts.

``load_annotation_file`` names the file in every error (bad JSON, a missing list, a malformed image
entry). ``clean_annotations`` drops the annotations that cannot be trained or scored on (bad boxes,
unknown images or categories), counting each reason with an example annotation id so that the dataset
can report them in one warning instead of dropping them without a word.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch


class AnnotationFileError(ValueError):
    """An annotation file that is not COCO-format JSON; the message names the file and the entry."""


def load_annotation_file(path: str | Path) -> dict:
    """The parsed file, with ``images``, ``annotations`` and ``categories`` lists (the last may be empty).

    Image entries must be objects with an integer ``id`` (unique) and a string ``file_name``; ``width``
    and ``height``, when given, positive integers. Annotation entries are checked by clean_annotations.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as error:
        raise AnnotationFileError(f"annotation file {path} is not valid JSON: {error.msg} at line {error.lineno}, "
                                  f"column {error.colno}") from error
    except UnicodeDecodeError as error:
        raise AnnotationFileError(f"annotation file {path} is not UTF-8 JSON text ({error.reason} at byte "
                                  f"{error.start})") from error
    if not isinstance(data, dict):
        raise AnnotationFileError(f"annotation file {path} holds a JSON {type(data).__name__}; expected a COCO-format "
                                  "object with 'images', 'annotations' and 'categories' lists")
    for key in ("images", "annotations", "categories"):
        if key == "categories" and key not in data:
            data[key] = []
        if not isinstance(data.get(key), list):
            got = "no such key" if key not in data else f"a {type(data[key]).__name__}"
            raise AnnotationFileError(f"annotation file {path}: '{key}' must be a list, found {got}")
    seen = set()
    for index, image in enumerate(data["images"]):
        problem = _image_entry_problem(image)
        if problem is None and image["id"] in seen:
            problem = f"image id {image['id']} appears twice"
        if problem:
            raise AnnotationFileError(f"annotation file {path}: images[{index}] {problem} ({str(image)[:200]})")
        seen.add(image["id"])
    return data


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _image_entry_problem(image) -> str | None:
    if not isinstance(image, dict):
        return "is not an object"
    if not _is_int(image.get("id")):
        return "has no integer 'id'"
    if not isinstance(image.get("file_name"), str) or not image["file_name"]:
        return "has no 'file_name'"
    for key in ("width", "height"):
        if key in image and not (_is_int(image[key]) and image[key] > 0):
            return f"has '{key}' {image[key]!r}, not a positive integer"
    return None


@dataclass
class AnnotationReport:
    """What clean_annotations dropped: reason -> [count, an example annotation id]."""

    total: int = 0
    dropped: dict[str, list] = field(default_factory=dict)

    def add(self, reason: str, ann_id) -> None:
        entry = self.dropped.setdefault(reason, [0, ann_id])
        entry[0] += 1

    @property
    def num_dropped(self) -> int:
        return sum(count for count, _ in self.dropped.values())

    def message(self, path: str | Path) -> str:
        reasons = "; ".join(f"{count} {reason} (e.g. annotation id {example})"
                            for reason, (count, example) in self.dropped.items())
        return (f"{path}: dropped {self.num_dropped} of {self.total} annotations, which cannot be trained or "
                f"scored on: {reasons}")


def clean_annotations(data: dict) -> tuple[dict, AnnotationReport]:
    """``data`` without the annotations that cannot be used, and what was dropped and why.

    Dropped: entries that are not objects, whose image_id is not among the images, whose category_id is
    not an integer or (when the file lists categories) not among them, whose bbox is not 4 finite numbers,
    has a zero or negative width or height, or lies wholly outside its image. A box partly outside is
    kept (the loader clamps it). The test on the box is the loader's own (float32 xyxy, clamped to the
    image), so a box kept here is never dropped silently later.
    """
    images = {image["id"]: image for image in data["images"]}
    category_ids = {c.get("id") for c in data["categories"] if isinstance(c, dict)}
    report = AnnotationReport(total=len(data["annotations"]))
    candidates = []
    for index, ann in enumerate(data["annotations"]):
        ann_id = ann.get("id", f"#{index}") if isinstance(ann, dict) else f"#{index}"
        reason = _entry_problem(ann, images, category_ids)
        if reason:
            report.add(reason, ann_id)
        else:
            candidates.append((ann, ann_id))
    kept = []
    if candidates:
        reasons = _box_problems([ann for ann, _ in candidates], images)
        for (ann, ann_id), reason in zip(candidates, reasons):
            if reason:
                report.add(reason, ann_id)
            else:
                kept.append(ann)
    return {**data, "annotations": kept}, report


def _entry_problem(ann, images: dict, category_ids: set) -> str | None:
    if not isinstance(ann, dict):
        return "entries that are not objects"
    if not _is_int(ann.get("image_id")) or ann["image_id"] not in images:
        return "with an image_id that is not among the file's images"
    if not _is_int(ann.get("category_id")) or ann["category_id"] < 0:
        return "without a category_id that is an integer >= 0"
    if category_ids and ann["category_id"] not in category_ids:
        return "with a category_id that is not among the file's categories"
    bbox = ann.get("bbox")
    if not (isinstance(bbox, (list, tuple)) and len(bbox) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox)):
        return "whose bbox is not 4 numbers"
    if not all(math.isfinite(v) for v in bbox):
        return "whose bbox has NaN or infinite values"
    if bbox[2] < 0 or bbox[3] < 0:
        return "with a negative width or height"
    if bbox[2] == 0 or bbox[3] == 0:
        return "with zero width or height"
    area = ann.get("area", 0.0)
    if not (isinstance(area, (int, float)) and not isinstance(area, bool) and math.isfinite(area)):
        return "whose area is not a finite number"
    return None


def _box_problems(anns: list[dict], images: dict) -> list[str | None]:
    """Per annotation: None, or why its box vanishes once clamped to the image as the loader does it."""
    boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float64).to(torch.float32)  # (n, 4) xywh
    boxes[:, 2:] += boxes[:, :2]  # (n, 4) xyxy
    sizes = [(images[a["image_id"]].get("width"), images[a["image_id"]].get("height")) for a in anns]
    # Without a recorded size the box can only be clamped at zero here; the loader checks the file's size.
    width = torch.tensor([w if w else math.inf for w, _ in sizes], dtype=torch.float32)  # (n,)
    height = torch.tensor([h if h else math.inf for _, h in sizes], dtype=torch.float32)  # (n,)
    x0, x1 = boxes[:, 0].clamp(min=0).minimum(width), boxes[:, 2].clamp(min=0).minimum(width)
    y0, y1 = boxes[:, 1].clamp(min=0).minimum(height), boxes[:, 3].clamp(min=0).minimum(height)
    too_small = (boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1])  # (n,) lost to float32 rounding
    outside = (x1 <= x0) | (y1 <= y0)  # (n,)
    reasons = []
    for small, out in zip(too_small.tolist(), outside.tolist()):
        reasons.append("whose width or height rounds to zero in float32" if small
                       else "lying wholly outside their image" if out else None)
    return reasons


def max_category_id(data: dict) -> int | None:
    """The largest category id among the annotations and the category list (None when there are none)."""
    ids = [a["category_id"] for a in data["annotations"]]
    ids += [c["id"] for c in data["categories"] if isinstance(c, dict) and _is_int(c.get("id"))]
    return max(ids) if ids else None


def largest_annotated_category(data: dict) -> tuple[int, object] | None:
    """(largest category_id among the annotations, the id of an annotation that has it), or None."""
    best = None
    for ann in data["annotations"]:
        if best is None or ann["category_id"] > best[0]:
            best = (ann["category_id"], ann.get("id"))
    return best
