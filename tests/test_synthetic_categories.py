"""datasets/synthetic.py with dataset.num_categories: a set with fewer classes, for fine-tuning examples."""

from __future__ import annotations

import json

import pytest

from datasets import build_dataset, ensure_synthetic_dataset
from datasets.synthetic import CLASSES

SMALL = {"num_train": 6, "num_val": 3, "image_size": 48, "seed": 5}


def instances(root, split: str) -> dict:
    return json.loads((root / "annotations" / f"instances_{split}2017.json").read_text())


@pytest.mark.parametrize("num_categories", [1, 3])
def test_fewer_categories_hold_only_the_first_classes(tmp_path, num_categories):
    root = ensure_synthetic_dataset(tmp_path / "syn", num_categories=num_categories, **SMALL)
    expected_ids = [c[0] for c in CLASSES[:num_categories]]
    for split in ("train", "val"):
        data = instances(root, split)
        assert [c["id"] for c in data["categories"]] == expected_ids
        assert [c["name"] for c in data["categories"]] == [c[1] for c in CLASSES[:num_categories]]
        used = {a["category_id"] for a in data["annotations"]}
        assert used and used <= set(expected_ids), used
        # Each image holds distinct classes, so at most num_categories objects.
        per_image = {}
        for a in data["annotations"]:
            per_image[a["image_id"]] = per_image.get(a["image_id"], 0) + 1
        assert max(per_image.values()) <= num_categories


def test_all_categories_is_the_default_set(tmp_path):
    default = ensure_synthetic_dataset(tmp_path / "default", **SMALL)
    explicit = ensure_synthetic_dataset(tmp_path / "six", num_categories=len(CLASSES), **SMALL)
    fewer = ensure_synthetic_dataset(tmp_path / "three", num_categories=3, **SMALL)
    for split in ("train", "val"):
        assert instances(default, split) == instances(explicit, split)
        assert instances(default, split)["annotations"] != instances(fewer, split)["annotations"]


def test_changing_num_categories_regenerates_the_set(tmp_path):
    root = ensure_synthetic_dataset(tmp_path / "syn", **SMALL)
    assert len(instances(root, "train")["categories"]) == len(CLASSES)
    ensure_synthetic_dataset(root, num_categories=2, **SMALL)
    assert len(instances(root, "train")["categories"]) == 2


def test_the_dataset_config_key_reaches_the_set(tmp_path):
    cfg = {
        "name": "synthetic",
        "root": str(tmp_path / "syn"),
        **SMALL,
        "num_categories": 2,
        "train_scales": [48],
        "max_size": 64,
        "val_size": 48,
        "crop": False,
    }
    dataset = build_dataset("val", cfg)
    assert sorted(dataset.coco.cats) == [1, 2]
    assert all(int(label) in (1, 2) for i in range(len(dataset)) for label in dataset[i][1]["labels"])


@pytest.mark.parametrize("bad", [0, len(CLASSES) + 1, 2.5, True, "3"])
def test_bad_num_categories_names_the_key(tmp_path, bad):
    with pytest.raises(ValueError, match=rf"dataset\.num_categories must be an integer from 1 to {len(CLASSES)}"):
        ensure_synthetic_dataset(tmp_path / "syn", num_categories=bad, **SMALL)
    assert not (tmp_path / "syn").exists()
