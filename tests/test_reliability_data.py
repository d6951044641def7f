"""Data checked before training: missing and damaged images, bad annotations, category ids, bad JSON.

Each test writes its own small COCO-format set under tmp_path (datasets/annotations.py, image_files.py,
coco.py; engine/checkpoint/num_classes.py).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from PIL import Image

from datasets import AnnotationFileError, ImageReadError, build_dataset, read_dataset_config
from engine.checkpoint.num_classes import resolve_num_classes

SMALL = dict(train_scales=[32], max_size=48, val_size=32, crop=False)


def write_set(root: Path, split: str = "val", *, annotations=None, categories=None, images=None) -> dict:
    """A custom-format split: 3 images of 40x30 (w x h) under root/<split>/, the json at root/<split>.json."""
    image_dir = root / split
    image_dir.mkdir(parents=True, exist_ok=True)
    images = (
        images
        if images is not None
        else [{"id": i, "file_name": f"{i}.jpg", "width": 40, "height": 30} for i in (1, 2, 3)]
    )
    for image in images:
        Image.new("RGB", (image.get("width", 40), image.get("height", 30)), (90, 120, 150)).save(
            image_dir / image["file_name"]
        )
    if annotations is None:
        annotations = [
            {"id": 10 + i, "image_id": i, "category_id": 1, "bbox": [5, 5, 10, 10], "area": 100.0, "iscrowd": 0}
            for i in (1, 2, 3)
        ]
    data = {
        "images": images,
        "annotations": annotations,
        "categories": categories if categories is not None else [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}],
    }
    (root / f"{split}.json").write_text(json.dumps(data))
    return data


def custom(root: Path, **extra) -> dict:
    return {
        "name": "custom",
        "train_images": str(root / "train"),
        "train_annotations": str(root / "train.json"),
        "val_images": str(root / "val"),
        "val_annotations": str(root / "val.json"),
        **SMALL,
        **extra,
    }


# ------------------------------------------------------------------------------------------- image files


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_missing_image_is_found_on_construction(tmp_path, split):
    write_set(tmp_path, split)
    (tmp_path / split / "2.jpg").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=rf"1 of the 3 images listed in .*{split}\.json are not in "
        rf".*{split} \(e\.g\. 2\.jpg\)",
    ):
        build_dataset(split, custom(tmp_path))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_damaged_validation_image_is_found_on_construction(tmp_path, damage):
    write_set(tmp_path, "val")
    path = tmp_path / "val" / "3.jpg"
    data = path.read_bytes()
    path.write_bytes({"garbage": b"not an image" * 20, "truncated": data[: len(data) // 2], "empty": b""}[damage])
    with pytest.raises(ImageReadError, match=r"1 of the 3 images of .*val\.json cannot be used: .*val/3\.jpg"):
        build_dataset("val", custom(tmp_path))


def test_training_images_are_opened_only_with_verify(tmp_path):
    write_set(tmp_path, "train")
    (tmp_path / "train" / "1.jpg").write_bytes(b"\xff\xd8 broken")
    dataset = build_dataset("train", custom(tmp_path, verify=False))  # COCO-sized sets: too slow to open all
    with pytest.raises(ImageReadError, match=r"cannot read image .*train/1\.jpg \(image id 1\)"):
        dataset[0]
    with pytest.raises(ImageReadError, match=r"train/1\.jpg"):
        build_dataset("train", custom(tmp_path, verify=True))


def test_an_image_of_another_size_than_recorded_is_found(tmp_path):
    write_set(tmp_path, "val")
    Image.new("RGB", (30, 40)).save(tmp_path / "val" / "2.jpg")  # rotated: the boxes would be misplaced
    with pytest.raises(ImageReadError, match=r"val/2\.jpg \(image id 2\) is 30x40 but the annotation file says 40x30"):
        build_dataset("val", custom(tmp_path))


def test_only_the_checking_rank_opens_the_images(tmp_path):
    write_set(tmp_path, "val")
    (tmp_path / "val" / "1.jpg").write_bytes(b"")
    assert len(build_dataset("val", custom(tmp_path), check=False)) == 3  # rank 0 has checked for the others


# ------------------------------------------------------------------------------------------- annotations


def test_unusable_annotations_are_dropped_and_reported_in_one_warning(tmp_path, caplog):
    good = {"image_id": 1, "category_id": 1, "bbox": [5, 5, 10, 10], "area": 100.0, "iscrowd": 0}
    annotations = [
        {**good, "id": 1},
        {**good, "id": 2, "bbox": [5, 5, 0, 10]},  # zero width
        {**good, "id": 3, "bbox": [5, 5, 3, 0]},  # zero height
        {**good, "id": 4, "bbox": [5, 5, -4, 10]},  # negative width
        {**good, "id": 5, "bbox": [5, math.nan, 4, 10]},  # NaN
        {**good, "id": 6, "bbox": [50, 5, 10, 10]},  # wholly right of the 40-wide image
        {**good, "id": 7, "image_id": 99},  # no such image
        {**good, "id": 8, "category_id": 5},  # not among the categories
        {**good, "id": 9, "bbox": [1, 2, 3]},  # not 4 numbers
        {**good, "id": 11, "image_id": 2, "bbox": [35, 25, 10, 10]},  # partly outside: kept, clamped
    ]
    write_set(tmp_path, "val", annotations=annotations)
    with caplog.at_level(logging.WARNING, logger="datasets"):
        dataset = build_dataset("val", custom(tmp_path))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    message = warnings[0]
    assert "val.json: dropped 8 of 10 annotations" in message
    for expected in (
        "2 with zero width or height (e.g. annotation id 2)",
        "1 with a negative width or height (e.g. annotation id 4)",
        "1 whose bbox has NaN or infinite values (e.g. annotation id 5)",
        "1 lying wholly outside their image (e.g. annotation id 6)",
        "1 with an image_id that is not among the file's images (e.g. annotation id 7)",
        "1 with a category_id that is not among the file's categories (e.g. annotation id 8)",
        "1 whose bbox is not 4 numbers (e.g. annotation id 9)",
    ):
        assert expected in message, (expected, message)
    assert sorted(dataset.coco.anns) == [1, 11]  # evaluation's ground truth has none of the dropped ones
    _, target = dataset[0]
    assert target["labels"].tolist() == [1]


def test_a_clean_set_gives_no_warning(tmp_path, caplog):
    write_set(tmp_path, "val")
    with caplog.at_level(logging.WARNING, logger="datasets"):
        build_dataset("val", custom(tmp_path))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "annotations, detail",
    [
        ([], "lists 3 images and 0 annotations; there is nothing to score"),
        ([{"id": 1, "image_id": 1, "category_id": 1, "bbox": [5, 5, 0, 0]}], "1 of them dropped as unusable"),
        ([{"id": 1, "image_id": 1, "category_id": 1, "bbox": [5, 5, 9, 9], "iscrowd": 1}], "nothing to score"),
    ],
)
def test_a_validation_set_without_annotations_is_an_error(tmp_path, annotations, detail):
    write_set(tmp_path, "val", annotations=annotations)
    with pytest.raises(
        ValueError,
        match=rf"the val split has no usable annotations: .*val\.json .*{detail}.*"
        r"(AP would be -1|)",
    ):
        build_dataset("val", custom(tmp_path))


def test_a_training_set_without_annotations_is_an_error(tmp_path):
    write_set(tmp_path, "train", annotations=[])
    with pytest.raises(ValueError, match=r"the train split has no usable annotations.*nothing to learn from"):
        build_dataset("train", custom(tmp_path))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"images": [], "annotations": [', r"val\.json is not valid JSON: Expecting value at line 1, column 32"),
        ('{"images": "a\tb"}', r"val\.json is not valid JSON: Invalid control character at line 1, column 14$"),
        ("[1, 2]", r"val\.json holds a JSON list; expected a COCO-format object"),
        ('{"annotations": []}', r"val\.json: 'images' must be a list, found no such key"),
        ('{"images": [{"id": 1}], "annotations": []}', r"val\.json: images\[0\] has no 'file_name'"),
        (
            '{"images": [{"id": 1, "file_name": "a.jpg"}, {"id": 1, "file_name": "b.jpg"}], "annotations": []}',
            r"images\[1\] image id 1 appears twice",
        ),
        (b'{"images": "\xc3\x28"}', r"val\.json is not UTF-8 JSON text \(invalid continuation byte at byte 12\)"),
        # Two annotations with one id: pycocotools would give the second's box to the first's image.
        (
            '{"images": [{"id": 1, "file_name": "1.jpg"}], "annotations": ['
            '{"id": 7, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]},'
            '{"id": 7, "image_id": 1, "category_id": 2, "bbox": [2, 2, 5, 5]}]}',
            r"val\.json: annotations\[1\] has id 7, which annotations\[0\] has too \(annotation ids must be unique",
        ),
        (
            '{"images": [{"id": 1, "file_name": "1.jpg"}], "annotations": [{"image_id": 1, "category_id": 1, '
            '"bbox": [1, 1, 5, 5]}]}',
            r"val\.json: annotations\[0\] has no 'id'",
        ),
        (
            '{"images": [{"id": 1, "file_name": "1.jpg"}], '
            '"annotations": [{"id": 3, "image_id": 1, "category_id": 1}]}',
            r"val\.json: annotations\[0\] \(id 3\) has no 'bbox'",
        ),
        (
            '{"images": [{"id": 1, "file_name": "1.jpg"}], '
            '"annotations": [{"id": "a3", "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]}]}',
            r"annotations\[0\] has id 'a3', not an integer",
        ),
        (
            '{"images": [{"id": 1, "file_name": "1.jpg"}], "annotations": [[1, 2]]}',
            r"annotations\[0\] is not an object",
        ),
    ],
)
def test_a_malformed_annotation_file_is_named(tmp_path, content, message):
    write_set(tmp_path, "val")
    path = tmp_path / "val.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(AnnotationFileError, match=message):
        build_dataset("val", custom(tmp_path))


# ----------------------------------------------------------------------------------- classes and categories


def test_num_classes_null_is_the_largest_category_id_plus_one(tmp_path, caplog):
    write_set(tmp_path, "train", categories=[{"id": 1, "name": "a"}, {"id": 4, "name": "d"}])
    write_set(tmp_path, "val", categories=[{"id": 1, "name": "a"}, {"id": 4, "name": "d"}])
    data = {split: build_dataset(split, custom(tmp_path)) for split in ("train", "val")}
    with caplog.at_level(logging.INFO, logger="engine"):
        assert resolve_num_classes(None, data) == 5  # id 4 is listed, if not annotated: the head must have it
    assert "model.num_classes=null: using 5, the largest category id in" in caplog.text
    assert resolve_num_classes(9, data) == 9


def test_a_category_id_beyond_num_classes_names_file_id_and_fix(tmp_path):
    annotations = [
        {"id": 77, "image_id": 1, "category_id": 12, "bbox": [1, 1, 5, 5]},
        {"id": 78, "image_id": 2, "category_id": 3, "bbox": [1, 1, 5, 5]},
    ]
    write_set(tmp_path, "train", annotations=annotations, categories=[])
    data = {"train": build_dataset("train", custom(tmp_path))}
    with pytest.raises(
        ValueError,
        match=r"train\.json \(train\) has category id 12 \(e\.g\. annotation id 77\), "
        r"but model\.num_classes=7 covers ids 0\.\.6 only: set "
        r"model\.num_classes=13",
    ):
        resolve_num_classes(7, data)
    assert resolve_num_classes(None, data) == 13
    # A resumed model keeps its classes: the fix is a new run from its checkpoint, not a setting it ignores.
    with pytest.raises(
        ValueError,
        match=r"but the model resumed from run/checkpoint\.pth \(7 classes\) covers ids "
        r"0\.\.6 only: a resumed model keeps its classes: fix the data, or start a "
        r"new run from that checkpoint with model\.init_from=run/checkpoint\.pth "
        r"model\.num_classes=13 \(resume=null\)",
    ):
        resolve_num_classes(7, data, resumed_from="run/checkpoint.pth")


def test_validation_category_ids_are_checked_too(tmp_path):
    write_set(tmp_path, "train")
    write_set(tmp_path, "val", annotations=[{"id": 5, "image_id": 1, "category_id": 2, "bbox": [1, 1, 5, 5]}])
    data = {split: build_dataset(split, custom(tmp_path)) for split in ("train", "val")}
    # categories list 1..2 in both: null gives 3, fits; a smaller explicit value does not
    assert resolve_num_classes(None, data) == 3
    with pytest.raises(ValueError, match=r"val\.json \(val\) has category id 2 \(e\.g\. annotation id 5\)"):
        resolve_num_classes(2, data)


def test_evaluation_takes_the_classes_of_the_checkpoint(tmp_path):
    write_set(tmp_path, "val", annotations=[{"id": 5, "image_id": 1, "category_id": 2, "bbox": [1, 1, 5, 5]}])
    data = {"val": build_dataset("val", custom(tmp_path))}
    assert resolve_num_classes(4, data, evaluated="run/checkpoint.pth") == 4
    with pytest.raises(
        ValueError,
        match=r"the checkpoint's class head \(2 classes\) covers ids 0\.\.1 only: this "
        r"checkpoint was trained for other category ids",
    ):
        resolve_num_classes(2, data, evaluated="run/checkpoint.pth")


# ---------------------------------------------------------------------------------------- dataset configs


def test_custom_needs_the_paths_of_the_split_it_builds(tmp_path):
    write_set(tmp_path, "val")
    cfg = custom(tmp_path, train_images=None, train_annotations=None)
    assert len(build_dataset("val", cfg)) == 3  # evaluation needs only the val_ paths
    with pytest.raises(
        ValueError,
        match=r"dataset=custom needs dataset\.train_images and "
        r"dataset\.train_annotations",
    ):
        build_dataset("train", cfg)
    with pytest.raises(FileNotFoundError, match=r"dataset\.val_annotations: annotation file not found: .*nope\.json"):
        build_dataset("val", custom(tmp_path, val_annotations=str(tmp_path / "nope.json")))


@pytest.mark.parametrize(
    "cfg, error, message",
    [
        ({"name": "voc", "root": "x"}, ValueError, r"dataset\.name must be one of coco, synthetic, custom, got 'voc'"),
        (
            {"name": "coco", "num_train": 3},
            Exception,
            r"Key 'num_train' not in 'CocoDatasetConfig'\s+full_key: "
            r"dataset\.num_train",
        ),
        (
            {"name": "synthetic", "num_val": "many"},
            ValueError,
            r"'many' of type 'str' could not be converted to "
            r"Integer\s+full_key: dataset\.num_val",
        ),
        ({"name": "synthetic", "num_val": 0}, ValueError, r"dataset\.num_val must be an integer >= 1, got 0"),
        ({"name": "coco", "train_scales": []}, ValueError, r"dataset\.train_scales must be a non-empty list"),
        ({"name": "custom", "verify": "often"}, ValueError, r"'often' is not a valid bool"),
    ],
)
def test_bad_dataset_settings_name_the_key(cfg, error, message):
    with pytest.raises(error, match=message):
        read_dataset_config(cfg)
