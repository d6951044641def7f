"""A small synthetic detection set written to disk in the COCO 2017 layout, deterministic from a seed.

Each image is a plain, mildly noisy background with 1-5 objects of distinct classes; each class is a
solid colour and shape of its own (so a small detector trained from scratch on a CPU learns it in
minutes), 15-50% of the image side, with some overlap. Images are slightly non-square in either
orientation so that batches need padding. The set is read back through ``datasets.coco.CocoDetection``
like COCO itself::

    root/train2017/000000000001.jpg ...
    root/val2017/...
    root/annotations/instances_train2017.json, instances_val2017.json
    root/synthetic_manifest.json      generation parameters; written last, so its presence means complete

The same parameters give byte-identical json and identical JPEG files (on the same Pillow/libjpeg).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

log = logging.getLogger(__name__)

MANIFEST = "synthetic_manifest.json"
FORMAT_VERSION = 1  # bump when the drawing changes, so old sets on disk are regenerated
# A split of at least 2 x IMAGES_PER_WRITER images is written by up to MAX_WRITERS processes (a 5,000-image set
# took minutes in one); smaller ones in this process, where starting the others would cost more.
IMAGES_PER_WRITER = 256
MAX_WRITERS = 8

# (COCO category id, name, supercategory, RGB, shape). Valid COCO ids, so num_classes=91 works.
CLASSES = (
    (1, "person", "person", (220, 40, 40), "rectangle"),
    (2, "bicycle", "vehicle", (40, 170, 60), "ellipse"),
    (3, "car", "vehicle", (40, 70, 220), "triangle"),
    (4, "motorcycle", "vehicle", (235, 205, 30), "diamond"),
    (5, "airplane", "vehicle", (200, 50, 200), "rectangle"),
    (6, "bus", "vehicle", (30, 200, 210), "ellipse"),
)
# Fraction of the box a shape fills: COCO's "area" is the segment area, which COCOeval uses for the
# small/medium/large split.
SHAPE_FILL = {"rectangle": 1.0, "ellipse": math.pi / 4, "triangle": 0.5, "diamond": 0.5}
SPLIT_CODES = {"train": 0, "val": 1}
MAX_OBJECTS = 5
OBJECT_SIDE = (0.15, 0.5)  # object side as a fraction of the image side
MAX_COVERED = 0.4  # a new object may cover at most this fraction of an earlier (occluded) one


def _place_objects(
    rng: np.random.Generator, *, height: int, width: int, num_categories: int
) -> list[tuple[int, list[int]]]:
    """[(class index < num_categories, [x0, y0, x1, y1])] integer pixel boxes, drawn in order (later on top)."""
    count = int(rng.integers(1, MAX_OBJECTS + 1))
    classes = rng.permutation(num_categories)[:count]
    placed: list[tuple[int, list[int]]] = []
    for cls in classes:
        for _ in range(20):  # rejection sampling: keep every object recognisable under overlap
            w = max(2, round(rng.uniform(*OBJECT_SIDE) * width))
            h = max(2, round(rng.uniform(*OBJECT_SIDE) * height))
            x0 = int(rng.integers(0, width - w + 1))
            y0 = int(rng.integers(0, height - h + 1))
            box = [x0, y0, x0 + w, y0 + h]
            if all(_covered_fraction(box, other) <= MAX_COVERED for _, other in placed):
                placed.append((int(cls), box))
                break
    return placed


def _covered_fraction(top: list[int], below: list[int]) -> float:
    """Fraction of box ``below`` hidden under box ``top`` (both xyxy)."""
    iw = max(0, min(top[2], below[2]) - max(top[0], below[0]))
    ih = max(0, min(top[3], below[3]) - max(top[1], below[1]))
    return iw * ih / ((below[2] - below[0]) * (below[3] - below[1]))


def _draw(draw: ImageDraw.ImageDraw, *, shape: str, box: list[int], colour: tuple[int, int, int]) -> None:
    # PIL's coordinates are inclusive: the last covered pixel is x1 - 1, so the drawn extent equals box.
    x0, y0, x1, y1 = box[0], box[1], box[2] - 1, box[3] - 1
    if shape == "rectangle":
        draw.rectangle((x0, y0, x1, y1), fill=colour)
    elif shape == "ellipse":
        draw.ellipse((x0, y0, x1, y1), fill=colour)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)
    elif shape == "diamond":
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def make_image(
    *, seed: int, split: str, index: int, image_size: int, num_categories: int = len(CLASSES)
) -> tuple[Image.Image, list[dict]]:
    """One RGB image and its objects [{"category_id", "bbox" xywh, "area"}].

    Seeded by (seed, split, index) so that an image does not depend on how many others are made.
    The long side is ``image_size``, the short side 75-100% of it, in either orientation. Objects are of
    the first ``num_categories`` classes of CLASSES; with all of them the draws are those of the full set.
    """
    rng = np.random.default_rng([seed, SPLIT_CODES[split], index])
    short = round(image_size * rng.uniform(0.75, 1.0))
    height, width = (image_size, short) if rng.random() < 0.5 else (short, image_size)
    background = rng.integers(90, 170, size=3)  # dull grey-ish, far from the saturated class colours
    noise = rng.integers(-8, 9, size=(height, width, 3))
    pixels = np.clip(background[None, None, :] + noise, 0, 255).astype(np.uint8)  # (H, W, 3)
    image = Image.fromarray(pixels)  # (H, W, 3) uint8 -> RGB
    draw = ImageDraw.Draw(image)
    objects = []
    for cls, box in _place_objects(rng, height=height, width=width, num_categories=num_categories):
        category_id, _, _, colour, shape = CLASSES[cls]
        _draw(draw, shape=shape, box=box, colour=colour)
        w, h = box[2] - box[0], box[3] - box[1]
        objects.append(
            {
                "category_id": category_id,
                "bbox": [float(box[0]), float(box[1]), float(w), float(h)],
                "area": round(float(w * h * SHAPE_FILL[shape]), 2),
            }
        )
    return image, objects


def _write_image(job) -> tuple[dict, list[dict]]:
    """One image of a split written as JPEG: (its COCO image entry, its objects)."""
    image_dir, seed, split, index, image_size, num_categories = job
    image_id = index + 1  # COCO ids are positive
    image, objects = make_image(
        seed=seed, split=split, index=index, image_size=image_size, num_categories=num_categories
    )
    file_name = f"{image_id:012d}.jpg"
    image.save(image_dir / file_name, format="JPEG", quality=95)
    return {"id": image_id, "file_name": file_name, "height": image.height, "width": image.width}, objects


def write_split(
    root: Path, *, split: str, num_images: int, image_size: int, seed: int, num_categories: int = len(CLASSES)
) -> None:
    """Write ``root/{split}2017/*.jpg`` and ``root/annotations/instances_{split}2017.json``.

    The json lists the first ``num_categories`` categories of CLASSES, the ones the images hold.
    """
    image_dir = root / f"{split}2017"
    image_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(image_dir, seed, split, index, image_size, num_categories) for index in range(num_images)]
    processes = min(os.cpu_count() or 1, MAX_WRITERS)
    if num_images >= IMAGES_PER_WRITER * 2 and processes > 1 and "fork" in multiprocessing.get_all_start_methods():
        # Each image has its own random stream: written by several processes, the set is the same. Forked, so
        # that the writers import nothing again and need no guard in the caller's main module; they touch
        # only numpy and PIL.
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            written = pool.map(_write_image, jobs, chunksize=IMAGES_PER_WRITER // 4)
    else:
        written = map(_write_image, jobs)
    images, annotations = [], []
    for image_entry, objects in written:
        images.append(image_entry)
        for obj in objects:
            annotations.append({"id": len(annotations) + 1, "image_id": image_entry["id"], "iscrowd": 0, **obj})
    instances = {
        "info": {"description": f"synthetic shapes, seed {seed}", "version": str(FORMAT_VERSION)},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c[0], "name": c[1], "supercategory": c[2]} for c in CLASSES[:num_categories]],
    }
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    with open(root / "annotations" / f"instances_{split}2017.json", "w") as f:
        json.dump(instances, f, sort_keys=True)


def _read_manifest(root: Path) -> dict | None:
    try:
        with open(root / MANIFEST) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ensure_synthetic_dataset(
    root: str | Path,
    *,
    num_train: int = 256,
    num_val: int = 64,
    image_size: int = 128,
    seed: int = 0,
    num_categories: int | None = None,
) -> Path:
    """Make sure ``root`` holds the synthetic set of these parameters; write it if not. Returns root.

    ``num_categories`` (1..6, None for all 6) keeps the first classes of CLASSES (category ids 1..n): a set
    with other classes than the default one, e.g. to fine-tune a model trained on all six.

    Idempotent: a set whose manifest matches is reused; one with other parameters is replaced. The set
    is written to a temporary sibling directory and renamed into place, so a killed run never leaves
    a half set at ``root`` and concurrent ranks that race both end with the same complete set. A
    non-empty ``root`` without a manifest is not ours and is never deleted (FileExistsError).
    """
    if num_train < 1 or num_val < 1:
        raise ValueError(f"num_train and num_val must be positive, got {num_train} and {num_val}")
    if image_size < 16:
        raise ValueError(f"image_size must be at least 16 pixels, got {image_size}")
    if num_categories is None:
        num_categories = len(CLASSES)
    if (
        isinstance(num_categories, bool)
        or not isinstance(num_categories, int)
        or not 1 <= num_categories <= len(CLASSES)
    ):
        raise ValueError(
            f"dataset.num_categories must be an integer from 1 to {len(CLASSES)} (the synthetic "
            f"classes), got {num_categories!r}"
        )
    root = Path(root)
    params = {
        "format_version": FORMAT_VERSION,
        "num_train": int(num_train),
        "num_val": int(num_val),
        "image_size": int(image_size),
        "seed": int(seed),
        "num_categories": num_categories,
    }
    existing = _read_manifest(root)
    if existing == params:
        return root
    if existing is None and root.exists() and any(root.iterdir()):
        raise FileExistsError(
            f"{root} is not empty and has no {MANIFEST}: it is not a synthetic set written by this "
            "program, so it is left alone; point dataset.root elsewhere or remove it"
        )
    log.info("writing synthetic COCO-format set to %s (%s)", root, params)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.writing.", dir=root.parent))
    try:
        for split, num_images in (("train", num_train), ("val", num_val)):
            write_split(
                staging,
                split=split,
                num_images=num_images,
                image_size=image_size,
                seed=seed,
                num_categories=num_categories,
            )
        with open(staging / MANIFEST, "w") as f:
            json.dump(params, f, sort_keys=True)
        _install(staging, root, params)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def _install(staging: Path, root: Path, params: dict) -> None:
    """Rename the complete ``staging`` set to ``root``, moving an outdated or empty ``root`` away first."""
    if _read_manifest(root) == params:
        return  # another rank finished first; its set is identical to ours
    if root.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old.", dir=root.parent))
        with contextlib.suppress(FileNotFoundError):  # another process moved it first
            os.replace(root, old / root.name)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(staging, root)
    except OSError:
        # Another rank installed its copy between our check and the rename; same seed, same set.
        if _read_manifest(root) != params:
            raise
