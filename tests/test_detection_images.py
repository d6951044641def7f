"""engine/evaluation/detection_images.py: fixed validation images with detections and ground truth, into TensorBoard."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from helpers import FixedDetector, compose_train
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchvision.transforms.v2 import functional as F

from datasets import build_data_loader, build_dataset
from engine.evaluation.coco import evaluate_coco
from engine.evaluation.detection_images import (
    GROUND_TRUTH_COLOUR,
    MAX_SIDE,
    MIN_SIDE,
    DetectionImages,
    build_detection_images,
    display_scale,
    pick_image_ids,
)
from engine.reporting.tensorboard import ScalarWriter
from engine.runtime.precision import Precision
from models.postprocess import PostProcess


@pytest.fixture(scope="module")
def val_set(tmp_path_factory):
    cfg = {
        "name": "synthetic",
        "root": str(tmp_path_factory.mktemp("images") / "syn"),
        "num_train": 1,
        "num_val": 10,
        "image_size": 64,
        "seed": 2,
        "val_size": 64,
        "max_size": 80,
    }
    return build_dataset("val", cfg)


def test_image_ids_are_fixed_spread_and_hold_objects(val_set):
    ids = pick_image_ids(val_set.coco, 3)
    assert ids == pick_image_ids(val_set.coco, 3) and len(set(ids)) == 3
    assert ids == [1, 4, 7]  # 10 images with objects, every third from the first
    assert pick_image_ids(val_set.coco, 50) == sorted(val_set.coco.imgs)
    assert pick_image_ids(val_set.coco, 0) == []


def test_images_without_objects_are_passed_over(val_set):
    coco = val_set.coco
    emptied = {i: [] if i % 2 else anns for i, anns in coco.imgToAnns.items()}  # odd ids lose their objects
    view = type("View", (), {"imgs": coco.imgs, "imgToAnns": emptied})()
    assert pick_image_ids(view, 2) == [2, 6]


@pytest.mark.parametrize("size, expected", [((64, 48), 6.0), ((500, 375), 1.0), ((1600, 1200), MAX_SIDE / 1600)])
def test_display_scale(size, expected):
    height, width = size
    scale = display_scale(height=height, width=width)
    assert scale == pytest.approx(expected)
    assert MIN_SIDE <= max(height, width) * scale <= MAX_SIDE


def detection(image_id, xywh, score, category_id=1):
    return {"image_id": image_id, "category_id": category_id, "bbox": list(xywh), "score": score}


def test_detections_above_the_threshold_are_drawn_over_the_ground_truth(val_set):
    images = DetectionImages(dataset=val_set, num_images=2, min_score=0.5)
    image_id = images.image_ids[0]
    raw = val_set.load_image(image_id).as_subclass(torch.Tensor)
    height, width = raw.shape[-2:]
    scale = display_scale(height=height, width=width)

    ground_truth_only = images.render({})[image_id]
    assert ground_truth_only.shape == (3, round(height * scale), round(width * scale))
    assert ground_truth_only.dtype == torch.uint8
    plain = F.resize(raw, list(ground_truth_only.shape[-2:]), antialias=True)
    x, y, _w, h = val_set.coco.imgToAnns[image_id][0]["bbox"]
    left, middle = int(x * scale), int((y + h / 2) * scale)
    assert tuple(ground_truth_only[:, middle, left].tolist()) == GROUND_TRUTH_COLOUR
    assert not torch.equal(plain, ground_truth_only)

    shown, hidden = (4, 5, 20, 12), (30, 30, 20, 20)
    drawn = images.render({image_id: [detection(image_id, shown, 0.9), detection(image_id, hidden, 0.2)]})
    changed = (drawn[image_id] != ground_truth_only).any(0).nonzero()  # (n, 2) as (y, x)
    assert len(changed) > 0
    x0, y0, x1, y1 = (v * scale for v in (shown[0], shown[1], shown[0] + shown[2], shown[1] + shown[3]))
    assert changed[:, 1].min() >= x0 - 1 and changed[:, 1].max() <= x1 + 1
    assert changed[:, 0].min() >= y0 - 1 and changed[:, 0].max() <= y1 + 1, "only the 0.9 box (and label)"
    other = images.image_ids[1]
    assert torch.equal(drawn[other], images.render({})[other]), "an image without detections shows its ground truth"


def test_written_to_tensorboard_under_one_tag_per_image(val_set, tmp_path):
    images = DetectionImages(dataset=val_set, num_images=3, min_score=0.3)
    writer = ScalarWriter(log_dir=tmp_path, enabled=True)
    detections = {i: [detection(i, (3, 3, 10, 10), 0.8)] for i in images.image_ids}
    images.write(writer, detections, step=4)
    images.write(writer, {}, step=8)
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    tags = sorted(events.Tags()["images"])
    assert tags == sorted(f"eval_images/image_id_{i}" for i in images.image_ids)
    for tag in tags:
        assert [e.step for e in events.Images(tag)] == [4, 8]


def test_evaluation_keeps_the_detections_of_the_images_asked_for(val_set):
    loader = build_data_loader(val_set, batch_size=3, num_workers=0, train=False)
    cpu = torch.device("cpu")
    with contextlib.redirect_stdout(io.StringIO()):
        evaluation = evaluate_coco(
            model=FixedDetector(),
            postprocess=PostProcess(),
            loader=loader,
            coco_gt=val_set.coco,
            device=cpu,
            precision=Precision(amp="none", device=cpu),
            keep_detections=[4, 1, 999],
        )
    assert evaluation.num_images == 10 and sorted(evaluation.detections) == [1, 4]
    for image_id, detections in evaluation.detections.items():
        assert len(detections) == 6 and {d["image_id"] for d in detections} == {image_id}
        best = max(detections, key=lambda d: d["score"])
        width, height = val_set.coco.imgs[image_id]["width"], val_set.coco.imgs[image_id]["height"]
        assert best["category_id"] == 0 and best["bbox"] == pytest.approx(
            [0.15 * width, 0.15 * height, 0.2 * width, 0.2 * height], abs=1e-3
        )


def test_settings_are_checked_with_their_keys(val_set):

    from engine.config.registry import check_config

    with pytest.raises(ValueError, match=r"eval_images must be an integer >= 0, got -1"):
        check_config(compose_train("eval_images=-1"))
    with pytest.raises(ValueError, match=r"eval_images_min_score must be a number in \[0, 1\] .*got 1.5"):
        check_config(compose_train("eval_images_min_score=1.5"))
    with pytest.raises(ValueError, match=r"DetectionImages: num_images must be an integer >= 0, got -2"):
        DetectionImages(dataset=val_set, num_images=-2, min_score=0.3)
    cfg = OmegaConf.create({"eval_images": 2, "eval_images_min_score": 0.3})
    assert len(build_detection_images(cfg, val_set, enabled=True).image_ids) == 2
    assert build_detection_images(cfg, val_set, enabled=False).image_ids == [], "ranks > 0 draw nothing"


def test_add_image_refuses_a_non_image(tmp_path):
    writer = ScalarWriter(log_dir=tmp_path, enabled=True)
    with pytest.raises(ValueError, match=r"add_image\('x'\): expected a \(3, H, W\) uint8 image, got \(4, 4\)"):
        writer.add_image("x", torch.zeros(4, 4, dtype=torch.uint8), 0)
    writer.close()


def test_class_names_are_drawn_in_a_font_that_has_their_glyphs_or_as_the_category_id():
    """PIL's default font (what torchvision draws with) has no glyph for "â" or "猫": such a name becomes its
    category id, never a row of boxes. The font found on the system draws at least what the default draws."""
    from PIL import ImageFont

    from engine.evaluation.label_font import LabelFont, label_font

    default = LabelFont(path=None, font=ImageFont.load_default())
    assert default.label("chateau", 3) == "chateau" and default.label("dog house", 4) == "dog house"
    assert default.label("château", 3) == "3" and default.label("猫", 17) == "17"
    found = label_font()
    assert found.label("chateau", 3) == "chateau"
    for name, category_id in (("château", 3), ("猫", 17)):
        assert found.label(name, category_id) in (name, str(category_id))
        assert (found.label(name, category_id) == name) == found.draws(name)
    if found.path and any(family in found.path for family in ("DejaVu", "Noto")):
        assert found.label("château", 3) == "château"  # fonts with Latin-1 and more


def test_without_a_font_on_the_system_the_default_is_used():
    from engine.evaluation.label_font import label_font

    assert label_font(font_dirs=("/nonexistent/fonts",)).path is None
