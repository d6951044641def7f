"""Reading a COCO-format annotation file, and checking it once before any training starts.

``load_annotation_file`` names the file in every error (bad JSON, a missing list, a malformed image entry,
an annotation without one of the fields every annotation needs, two annotations with one id: pycocotools
would index the second over the first and hand its box to the other's image). ``clean_annotations`` drops the
annotations whose values cannot be trained or scored on (bad boxes, unknown images or categories), counting
each reason with an example annotation id so that the dataset can report them in one warning instead of
dropping them without a word.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class AnnotationFileError(ValueError):
    """An annotation file that is not COCO-format JSON; the message names the file and the entry."""


def load_annotation_file(path: str | Path) -> dict:
    """The parsed file, with ``images``, ``annotations`` and ``categories`` lists (the last may be empty).

    Image entries must be objects with an integer ``id`` (unique) and a string ``file_name``; ``width``
    and ``height``, when given, positive integers. Annotation entries must be objects with an integer ``id``
    (unique) and the fields of ANNOTATION_FIELDS; their values are checked by clean_annotations.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as error:
        # Some of json's messages end in "at" ("Invalid control character at"): the position follows once.
        raise AnnotationFileError(
            f"annotation file {path} is not valid JSON: {error.msg.removesuffix(' at')} at "
            f"line {error.lineno}, column {error.colno}"
        ) from error
    except UnicodeDecodeError as error:
        raise AnnotationFileError(
            f"annotation file {path} is not UTF-8 JSON text ({error.reason} at byte {error.start})"
        ) from error
    if not isinstance(data, dict):
        raise AnnotationFileError(
            f"annotation file {path} holds a JSON {type(data).__name__}; expected a COCO-format "
            "object with 'images', 'annotations' and 'categories' lists"
        )
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
    first_index: dict[int, int] = {}
    for index, ann in enumerate(data["annotations"]):
        problem = _annotation_entry_problem(ann)
        if problem is None and ann["id"] in first_index:
            problem = (
                f"has id {ann['id']}, which annotations[{first_index[ann['id']]}] has too (annotation ids must "
                "be unique: give every annotation its own)"
            )
        if problem:
            raise AnnotationFileError(f"annotation file {path}: annotations[{index}] {problem} ({str(ann)[:200]})")
        first_index[ann["id"]] = index
    return data


# What every annotation must have (COCO's format; docs/own-data.md). Their values are checked apart.
ANNOTATION_FIELDS = ("id", "image_id", "category_id", "bbox")


def _annotation_entry_problem(ann) -> str | None:
    if not isinstance(ann, dict):
        return "is not an object"
    missing = [key for key in ANNOTATION_FIELDS if key not in ann]
    if missing:
        name = f" (id {ann['id']})" if "id" in ann else ""
        return f"{name} has no {', '.join(repr(k) for k in missing)}".lstrip()
    if not _is_int(ann["id"]):
        return f"has id {ann['id']!r}, not an integer"
    return None


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
        reasons = "; ".join(
            f"{count} {reason} (e.g. annotation id {example})" for reason, (count, example) in self.dropped.items()
        )
        return (
            f"{path}: dropped {self.num_dropped} of {self.total} annotations, which cannot be trained or "
            f"scored on: {reasons}"
        )


def clean_annotations(data: dict) -> tuple[dict, AnnotationReport]:
    """``data`` without the annotations that cannot be used, and what was dropped and why.

    Dropped: entries whose image_id is not among the images, whose category_id is
    not an integer >= 0 or (when the file lists categories) not among them, whose bbox is not 4 finite
    numbers, has a zero or negative width or height, or lies wholly outside its image, and whose area is
    not a finite number. A box partly outside is kept (the loader clamps it). The test on the box is the
    loader's own (float32 xyxy, clamped to the image), so a box kept here is never dropped later.
    Structure is checked per entry, the boxes all at once: a few seconds for all of COCO train.
    """
    images = {image["id"]: image for image in data["images"]}
    category_ids = {c.get("id") for c in data["categories"] if isinstance(c, dict)}
    report = AnnotationReport(total=len(data["annotations"]))
    candidates, candidate_ids = [], []
    for ann in data["annotations"]:
        reason = _entry_problem(ann, images, category_ids)
        if reason:
            report.add(reason, ann["id"])
        else:
            candidates.append(ann)
            candidate_ids.append(ann["id"])
    kept = []
    for ann, ann_id, reason in zip(candidates, candidate_ids, _box_problems(candidates, images)):
        if reason:
            report.add(reason, ann_id)
        else:
            kept.append(ann)
    return {**data, "annotations": kept}, report


_NUMBER = (int, float)  # exact types, as json gives them: bool is no number here


def _entry_problem(ann, images: dict, category_ids: set) -> str | None:
    """Why an entry's values make it unusable (the box's are _box_problems' part), or None."""
    if type(ann.get("image_id")) is not int or ann["image_id"] not in images:
        return "with an image_id that is not among the file's images"
    category_id = ann.get("category_id")
    if type(category_id) is not int or category_id < 0:
        return "without a category_id that is an integer >= 0"
    if category_ids and category_id not in category_ids:
        return "with a category_id that is not among the file's categories"
    bbox = ann.get("bbox")
    if type(bbox) not in (list, tuple) or len(bbox) != 4 or any(type(v) not in _NUMBER for v in bbox):
        return "whose bbox is not 4 numbers"
    if type(ann.get("area", 0.0)) not in _NUMBER:
        return "whose area is not a finite number"
    return None


# Why a box is dropped, checked in this order (the first that applies is reported).
_BOX_REASONS = (
    "whose bbox has NaN or infinite values",
    "with a negative width or height",
    "with zero width or height",
    "whose area is not a finite number",
    "whose width or height rounds to zero in float32",
    "lying wholly outside their image",
)


def _box_problems(anns: list[dict], images: dict) -> list[str | None]:
    """Per annotation: None, or why its box cannot be used, all boxes at once."""
    if not anns:
        return []
    xywh = np.array([a["bbox"] for a in anns], dtype=np.float64)  # (n, 4)
    area = np.array([a.get("area", 0.0) for a in anns], dtype=np.float64)  # (n,)
    # Without a recorded size a box can only be clamped at zero here; the loader checks the file's size.
    size = np.array(
        [(images[a["image_id"]].get("width") or np.inf, images[a["image_id"]].get("height") or np.inf) for a in anns],
        dtype=np.float32,
    )  # (n, 2) (w, h)
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(xywh).all(axis=1)
        # The loader's arithmetic: float32 xyxy, then clamped to [0, w] x [0, h].
        xyxy = xywh.astype(np.float32)
        xyxy[:, 2:] += xyxy[:, :2]
        clamped = np.clip(xyxy, 0, np.concatenate([size, size], axis=1))
        problems = np.stack(
            [
                ~finite,
                (xywh[:, 2] < 0) | (xywh[:, 3] < 0),
                (xywh[:, 2] == 0) | (xywh[:, 3] == 0),
                ~np.isfinite(area),
                (xyxy[:, 2] <= xyxy[:, 0]) | (xyxy[:, 3] <= xyxy[:, 1]),
                (clamped[:, 2] <= clamped[:, 0]) | (clamped[:, 3] <= clamped[:, 1]),
            ],
            axis=1,
        )  # (n, reasons)
    first = problems.argmax(axis=1)  # (n,) index of the first reason that applies
    return [_BOX_REASONS[r] if bad else None for r, bad in zip(first.tolist(), problems.any(axis=1).tolist())]


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
