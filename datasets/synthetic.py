"""A small synthetic detection set written to disk in the COCO 2017 layout, deterministic from a seed.

Each image is a plain, mildly noisy background with 1-5 objects of distinct classes; each class is a
solid colour and shape of its own (so a small detector trained from scratch on a CPU learns it in
minutes), 15-50% of the image side, with some overlap. Images are slightly non-square in either
orientation so that batches need padding. ``density="coco"`` makes a denser set on the same backgrounds,
closer to COCO's statistics: 2-20 objects an image (7 on average), of 24 classes that may repeat, many of
them small and overlapping (see _place_dense_objects). The set is read back through ``datasets.coco.CocoDetection``
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
# density="coco": every colour x shape of CLASSES, the six of CLASSES first (the same ids, colours and shapes),
# then the others on COCO's next ids and names (COCO has no id 12), so num_classes=26 covers them.
DENSE_CLASSES = CLASSES + (
    (7, "train", "vehicle", (40, 170, 60), "rectangle"),
    (8, "truck", "vehicle", (40, 70, 220), "rectangle"),
    (9, "boat", "vehicle", (235, 205, 30), "rectangle"),
    (10, "traffic light", "outdoor", (30, 200, 210), "rectangle"),
    (11, "fire hydrant", "outdoor", (220, 40, 40), "ellipse"),
    (13, "stop sign", "outdoor", (40, 70, 220), "ellipse"),
    (14, "parking meter", "outdoor", (235, 205, 30), "ellipse"),
    (15, "bench", "outdoor", (200, 50, 200), "ellipse"),
    (16, "bird", "animal", (220, 40, 40), "triangle"),
    (17, "cat", "animal", (40, 170, 60), "triangle"),
    (18, "dog", "animal", (235, 205, 30), "triangle"),
    (19, "horse", "animal", (200, 50, 200), "triangle"),
    (20, "sheep", "animal", (30, 200, 210), "triangle"),
    (21, "cow", "animal", (220, 40, 40), "diamond"),
    (22, "elephant", "animal", (40, 170, 60), "diamond"),
    (23, "bear", "animal", (40, 70, 220), "diamond"),
    (24, "zebra", "animal", (200, 50, 200), "diamond"),
    (25, "giraffe", "animal", (30, 200, 210), "diamond"),
)
DENSITIES = {"sparse": CLASSES, "coco": DENSE_CLASSES}  # dataset.density -> its classes
SPLIT_CODES = {"train": 0, "val": 1}
MAX_OBJECTS = 5
OBJECT_SIDE = (0.15, 0.5)  # object side as a fraction of the image side
MAX_COVERED = 0.4  # a new object may cover at most this fraction of an earlier (occluded) one
# density="coco"
DENSE_OBJECTS = (2, 20)  # objects an image: 1 + a geometric count of mean DENSE_MEAN_EXTRA, at most 20
DENSE_MEAN_EXTRA = 6  # so 7 objects an image on average (COCO train2017: 7.3), half of the images 5 or fewer
DENSE_CLASSES_PER_IMAGE = 6  # an image holds 1..6 of the classes, repeated (COCO: 2.9 classes, 7.3 objects)
DENSE_SCALE = (0.05, 0.4)  # sqrt(w * h) over the long image side, log-uniform: a third of the objects below 0.1
DENSE_ASPECT = 1.5  # w / h log-uniform in [1 / 1.5, 1.5]
DENSE_MAX_COVERED = 0.5  # all later objects together cover at most half of an earlier object's box


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


def _place_dense_objects(
    rng: np.random.Generator, *, height: int, width: int, num_categories: int
) -> list[tuple[int, list[int]]]:
    """As _place_objects, for density="coco": 2-20 objects (a geometric count: most images hold a few, some many)
    of 1..6 classes an image, each class possibly several times, sized log-uniformly from 5% to 40% of the long
    side. The cover of an earlier object's box by all later boxes together is at most DENSE_MAX_COVERED, so
    every object stays recognisable under a pile of others."""
    lo, hi = DENSE_OBJECTS
    count = min(hi, lo - 1 + int(rng.geometric(1 / DENSE_MEAN_EXTRA)))
    num_kinds = int(rng.integers(1, min(count, num_categories, DENSE_CLASSES_PER_IMAGE) + 1))
    classes = rng.choice(rng.permutation(num_categories)[:num_kinds], size=count)
    side = max(height, width)
    top = np.full((height, width), -1, dtype=np.int16)  # which placed box is uppermost at each pixel, -1 none
    visible: list[int] = []  # pixels of each placed box not under a later one
    placed: list[tuple[int, list[int]]] = []
    for cls in classes:
        # Rejection sampling. The second object finds a place (the first covers at most a fifth of the image, so
        # 50 misses in a row do not happen); a later one that finds none is left out of a crowded image.
        for _ in range(50):
            scale = math.exp(rng.uniform(*np.log(DENSE_SCALE)))
            aspect = math.sqrt(math.exp(rng.uniform(-math.log(DENSE_ASPECT), math.log(DENSE_ASPECT))))
            w = min(width, max(2, round(scale * aspect * side)))
            h = min(height, max(2, round(scale / aspect * side)))
            x0 = int(rng.integers(0, width - w + 1))
            y0 = int(rng.integers(0, height - h + 1))
            under = top[y0 : y0 + h, x0 : x0 + w]
            hidden = np.bincount(under[under >= 0], minlength=len(placed))  # pixels each placed box would lose
            areas = [(b[2] - b[0]) * (b[3] - b[1]) for _, b in placed]
            if all(v - n >= (1 - DENSE_MAX_COVERED) * a for v, n, a in zip(visible, hidden, areas)):
                visible = [v - n for v, n in zip(visible, hidden)] + [w * h]
                under[...] = len(placed)
                placed.append((int(cls), [x0, y0, x0 + w, y0 + h]))
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
    *,
    seed: int,
    split: str,
    index: int,
    image_size: int,
    num_categories: int = len(CLASSES),
    density: str = "sparse",
) -> tuple[Image.Image, list[dict]]:
    """One RGB image and its objects [{"category_id", "bbox" xywh, "area"}].

    Seeded by (seed, split, index) so that an image does not depend on how many others are made.
    The long side is ``image_size``, the short side 75-100% of it, in either orientation. Objects are of
    the first ``num_categories`` classes of DENSITIES[density]; with all of them the draws are those of the
    full set. The background is drawn the same for either density.
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
    place = _place_dense_objects if density == "coco" else _place_objects
    for cls, box in place(rng, height=height, width=width, num_categories=num_categories):
        category_id, _, _, colour, shape = DENSITIES[density][cls]
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
    image_dir, seed, split, index, image_size, num_categories, density = job
    image_id = index + 1  # COCO ids are positive
    image, objects = make_image(
        seed=seed, split=split, index=index, image_size=image_size, num_categories=num_categories, density=density
    )
    file_name = f"{image_id:012d}.jpg"
    image.save(image_dir / file_name, format="JPEG", quality=95)
    return {"id": image_id, "file_name": file_name, "height": image.height, "width": image.width}, objects


def write_split(
    root: Path,
    *,
    split: str,
    num_images: int,
    image_size: int,
    seed: int,
    num_categories: int = len(CLASSES),
    density: str = "sparse",
) -> None:
    """Write ``root/{split}2017/*.jpg`` and ``root/annotations/instances_{split}2017.json``.

    The json lists the first ``num_categories`` categories of DENSITIES[density], the ones the images hold.
    """
    image_dir = root / f"{split}2017"
    image_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(image_dir, seed, split, index, image_size, num_categories, density) for index in range(num_images)]
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
    description = f"synthetic shapes, seed {seed}" + (", COCO-like density" if density == "coco" else "")
    instances = {
        "info": {"description": description, "version": str(FORMAT_VERSION)},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c[0], "name": c[1], "supercategory": c[2]} for c in DENSITIES[density][:num_categories]],
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
    density: str = "sparse",
) -> Path:
    """Make sure ``root`` holds the synthetic set of these parameters; write it if not. Returns root.

    ``num_categories`` (1..6, None for all 6) keeps the first classes of CLASSES (category ids 1..n): a set
    with other classes than the default one, e.g. to fine-tune a model trained on all six.
    ``density`` "coco" writes the denser set of DENSE_CLASSES (``num_categories`` 1..24, None for all 24;
    category ids up to 25); its manifest records the density, so a set of the other density is never reused.

    Idempotent: a set whose manifest matches is reused; one with other parameters is replaced. The set
    is written to a temporary sibling directory and renamed into place, so a killed run never leaves
    a half set at ``root`` and concurrent ranks that race both end with the same complete set. A
    non-empty ``root`` without a manifest is not ours and is never deleted (FileExistsError).
    """
    if num_train < 1 or num_val < 1:
        raise ValueError(f"num_train and num_val must be positive, got {num_train} and {num_val}")
    if image_size < 16:
        raise ValueError(f"image_size must be at least 16 pixels, got {image_size}")
    if density not in DENSITIES:
        raise ValueError(f"dataset.density must be one of {', '.join(DENSITIES)}, got {density!r}")
    density = str(density)  # a StrEnum from the config: the manifest and the jobs hold the plain value
    classes = DENSITIES[density]
    if num_categories is None:
        num_categories = len(classes)
    if (
        isinstance(num_categories, bool)
        or not isinstance(num_categories, int)
        or not 1 <= num_categories <= len(classes)
    ):
        raise ValueError(
            f"dataset.num_categories must be an integer from 1 to {len(classes)} (the synthetic "
            f"classes at dataset.density={density}), got {num_categories!r}"
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
    if density != "sparse":  # the sparse set's manifest is as it was before there was a choice, so it stays valid
        params["density"] = density
    existing = _read_manifest(root)
    if existing == params:
        return root
    if existing is not None and existing.get("density", "sparse") != density:
        log.warning(
            "%s holds the synthetic set at dataset.density=%s: replacing it with dataset.density=%s (give each "
            "density its own dataset.root to keep both)",
            root,
            existing.get("density", "sparse"),
            density,
        )
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
                density=density,
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
