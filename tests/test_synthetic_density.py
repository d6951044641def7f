"""datasets/synthetic.py with dataset.density=coco: the denser set for one-to-many supervision, and the default
(sparse) set left exactly as it was."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict

import numpy as np
import pytest
from helpers import compose_train

from datasets import build_dataset, ensure_synthetic_dataset, read_dataset_config, synthetic
from datasets.coco_categories import COCO_CATEGORY_NAMES
from datasets.synthetic import CLASSES, DENSE_CLASSES, DENSE_MAX_COVERED, MANIFEST, SHAPE_FILL

SMALL = {"num_train": 6, "num_val": 3, "image_size": 48, "seed": 5}
DENSE = {"num_train": 96, "num_val": 16, "image_size": 160, "seed": 0, "density": "coco"}


def instances(root, split: str) -> dict:
    return json.loads((root / "annotations" / f"instances_{split}2017.json").read_text())


def per_image(data: dict) -> dict[int, list[dict]]:
    """Each image's annotations in drawing order (annotation ids follow it)."""
    anns = defaultdict(list)
    for a in sorted(data["annotations"], key=lambda a: a["id"]):
        anns[a["image_id"]].append(a)
    return anns


@pytest.fixture(scope="module")
def dense_root(tmp_path_factory):
    return ensure_synthetic_dataset(tmp_path_factory.mktemp("data") / "synthetic_dense", **DENSE)


# ------------------------------------------------------------------------------------------ the default set


def test_the_default_set_is_unchanged(tmp_path):
    """The sparse set's json and manifest as written before dataset.density existed (sha256 of the json files)."""
    root = ensure_synthetic_dataset(tmp_path / "syn", **SMALL)
    digests = {
        split: hashlib.sha256((root / "annotations" / f"instances_{split}2017.json").read_bytes()).hexdigest()
        for split in ("train", "val")
    }
    assert digests == {
        "train": "953bbe11987312fea8668f00ca738a2f64d5f59ac35d725fdf3fa4a2d0eb662f",
        "val": "647acbf7589d539aa7c26a18ae4607e5e8af39be7fb51e24618458ee68374073",
    }
    # No density key: a set on disk written before the setting is still the one asked for, and is not rewritten.
    assert json.loads((root / MANIFEST).read_text()) == {
        "format_version": 1,
        **{key: SMALL[key] for key in ("num_train", "num_val", "image_size", "seed")},
        "num_categories": len(CLASSES),
    }
    explicit = ensure_synthetic_dataset(tmp_path / "sparse", density="sparse", **SMALL)
    for name in ("annotations/instances_train2017.json", "annotations/instances_val2017.json", MANIFEST):
        assert (root / name).read_bytes() == (explicit / name).read_bytes()


def test_the_dense_classes_extend_the_default_ones():
    assert DENSE_CLASSES[: len(CLASSES)] == CLASSES
    assert len(DENSE_CLASSES) >= 20
    assert len({(colour, shape) for *_, colour, shape in DENSE_CLASSES}) == len(DENSE_CLASSES), "each looks unique"
    for category_id, name, *_ in DENSE_CLASSES:
        assert COCO_CATEGORY_NAMES[category_id] == name, "valid COCO ids with their COCO names"
    assert [c[0] for c in DENSE_CLASSES] == sorted(COCO_CATEGORY_NAMES)[: len(DENSE_CLASSES)]


# -------------------------------------------------------------------------------------------- the dense set


def test_dense_set_is_crowded_small_and_overlapping(dense_root):
    data = instances(dense_root, "train")
    images = {i["id"]: i for i in data["images"]}
    anns = per_image(data)
    assert set(anns) == set(images), "every image holds objects"
    counts = [len(a) for a in anns.values()]
    assert min(counts) >= 2 and max(counts) <= 20
    assert min(counts) <= 3 and max(counts) >= 15, "a spread: some images with a few, some with many"
    assert np.median(counts) < np.mean(counts), "most images hold a few"
    assert len({a["category_id"] for a in data["annotations"]}) >= 20
    assert any(len({a["category_id"] for a in image}) < len(image) for image in anns.values()), "classes repeat"
    small = overlapping = 0
    for image_id, image in anns.items():
        info = images[image_id]
        for i, a in enumerate(image):
            x, y, w, h = a["bbox"]
            assert w > 0 and h > 0 and a["iscrowd"] == 0
            assert x >= 0 and y >= 0 and x + w <= info["width"] and y + h <= info["height"]
            shape = next(c[4] for c in DENSE_CLASSES if c[0] == a["category_id"])
            assert a["area"] == round(w * h * SHAPE_FILL[shape], 2)
            small += min(w / info["width"], h / info["height"]) < 0.1
            for b in image[i + 1 :]:
                bx, by, bw, bh = b["bbox"]
                overlapping += min(x + w, bx + bw) > max(x, bx) and min(y + h, by + bh) > max(y, by)
    assert small >= 0.2 * len(data["annotations"]), "many objects have a side under a tenth of the image"
    assert overlapping >= len(anns) // 2, "objects overlap"


def test_dense_objects_stay_recognisable_under_the_later_ones(dense_root):
    """All later boxes together cover at most DENSE_MAX_COVERED of an earlier object's box."""
    data = instances(dense_root, "train")
    images = {i["id"]: i for i in data["images"]}
    for image_id, image in per_image(data).items():
        above = np.zeros((images[image_id]["height"], images[image_id]["width"]), dtype=bool)
        for a in reversed(image):  # from the top object down
            x, y, w, h = (int(v) for v in a["bbox"])
            assert above[y : y + h, x : x + w].mean() <= DENSE_MAX_COVERED
            above[y : y + h, x : x + w] = True


def test_dense_set_reads_back_through_the_coco_loader(dense_root):
    cfg = {
        "name": "synthetic",
        "root": str(dense_root),
        **DENSE,
        "num_categories": len(DENSE_CLASSES),  # the config's default is the sparse set's six
        "train_scales": [160],
        "max_size": 240,
        "val_size": 160,
        "crop": False,
    }
    dataset = build_dataset("val", cfg)
    assert len(dataset) == DENSE["num_val"]
    assert sorted(dataset.coco.cats) == [c[0] for c in DENSE_CLASSES]
    data = instances(dense_root, "val")
    assert dataset.num_annotations == len(data["annotations"])
    for index in range(len(dataset)):
        _, target = dataset[index]
        expected = [a["category_id"] for a in per_image(data)[int(target["image_id"])]]
        assert target["labels"].tolist() == expected


def test_dense_set_is_deterministic_from_the_seed(tmp_path, dense_root):
    again = ensure_synthetic_dataset(tmp_path / "again", **DENSE)
    other = ensure_synthetic_dataset(tmp_path / "other", **{**DENSE, "seed": 1})
    for split in ("train", "val"):
        name = f"annotations/instances_{split}2017.json"
        assert (dense_root / name).read_bytes() == (again / name).read_bytes()
        assert (dense_root / name).read_bytes() != (other / name).read_bytes()
        for image in sorted((dense_root / f"{split}2017").iterdir()):
            assert image.read_bytes() == (again / f"{split}2017" / image.name).read_bytes()


def test_parallel_writers_write_the_same_dense_set(tmp_path, monkeypatch):
    params = {**DENSE, "num_train": 8, "num_val": 1, "image_size": 64}
    alone = ensure_synthetic_dataset(tmp_path / "alone", **params)
    monkeypatch.setattr(synthetic, "IMAGES_PER_WRITER", 4)  # 8 images: several processes where there are cores
    together = ensure_synthetic_dataset(tmp_path / "together", **params)
    name = "annotations/instances_train2017.json"
    assert (alone / name).read_bytes() == (together / name).read_bytes()


@pytest.mark.parametrize("num_categories", [1, 10])
def test_dense_num_categories_keeps_the_first_classes(tmp_path, num_categories):
    root = ensure_synthetic_dataset(tmp_path / "syn", **{**DENSE, "num_train": 16}, num_categories=num_categories)
    expected_ids = [c[0] for c in DENSE_CLASSES[:num_categories]]
    data = instances(root, "train")
    assert [c["id"] for c in data["categories"]] == expected_ids
    used = {a["category_id"] for a in data["annotations"]}
    assert used <= set(expected_ids) and len(used) == num_categories
    assert all(len(image) >= 2 for image in per_image(data).values())


@pytest.mark.parametrize("bad", [0, len(DENSE_CLASSES) + 1])
def test_dense_num_categories_bound_is_its_class_count(tmp_path, bad):
    with pytest.raises(ValueError, match=rf"dataset\.num_categories must be an integer from 1 to {len(DENSE_CLASSES)}"):
        ensure_synthetic_dataset(tmp_path / "syn", num_categories=bad, **DENSE)
    assert not (tmp_path / "syn").exists()


def test_bad_density_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"dataset\.density must be one of sparse, coco, got 'dense'"):
        ensure_synthetic_dataset(tmp_path / "syn", **{**SMALL, "density": "dense"})
    assert not (tmp_path / "syn").exists()


# ------------------------------------------------------------------------------------- manifest and config


def test_switching_density_regenerates_the_set_and_says_so(tmp_path, monkeypatch, caplog):
    root = ensure_synthetic_dataset(tmp_path / "syn", **SMALL)
    assert len(instances(root, "train")["categories"]) == len(CLASSES)
    with caplog.at_level(logging.WARNING, logger=synthetic.__name__):
        ensure_synthetic_dataset(root, **SMALL, density="coco")
    assert "dataset.density=sparse: replacing it with dataset.density=coco" in caplog.text
    assert json.loads((root / MANIFEST).read_text())["density"] == "coco"
    assert len(instances(root, "train")["categories"]) == len(DENSE_CLASSES)
    with monkeypatch.context() as patch:
        patch.setattr(synthetic, "write_split", lambda *a, **k: pytest.fail("regenerated a matching set"))
        ensure_synthetic_dataset(root, **SMALL, density="coco")
    ensure_synthetic_dataset(root, **SMALL)  # and back
    assert "density" not in json.loads((root / MANIFEST).read_text())
    assert len(instances(root, "train")["categories"]) == len(CLASSES)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging/old leftovers"


def test_the_config_checks_num_categories_against_the_density():
    dense = read_dataset_config({"name": "synthetic", "density": "coco", "num_categories": len(DENSE_CLASSES)})
    assert dense.density == "coco"
    assert read_dataset_config({"name": "synthetic"}).density == "sparse"
    with pytest.raises(ValueError, match=rf"dataset\.num_categories must be 1\.\.{len(CLASSES)} at dataset\.density"):
        read_dataset_config({"name": "synthetic", "num_categories": len(DENSE_CLASSES)})


def test_synthetic_dense_config_selects_the_dense_set_in_its_own_root():
    cfg = compose_train("dataset=synthetic_dense")
    default = compose_train()
    assert cfg.dataset.name == "synthetic" and cfg.dataset.density == "coco"
    assert cfg.dataset.root != default.dataset.root
    assert cfg.dataset.num_categories == len(DENSE_CLASSES)
    assert cfg.model.num_classes == max(c[0] for c in DENSE_CLASSES) + 1
    assert cfg.model.num_queries >= 20, "a query for every object of the most crowded image"
    assert default.dataset.density == "sparse"
    assert compose_train("dataset.density=coco").dataset.density == "coco"  # the option on the default set
