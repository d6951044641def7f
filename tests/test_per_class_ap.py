"""Per-class AP: from the same COCOeval as the summary, in the evaluation json, the log table and TensorBoard."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import pytest
import torch
from pycocotools.coco import COCO

from datasets import CocoEvaluator, ensure_synthetic_dataset
from datasets.per_class_ap import category_names
from engine.evaluation.record import write_eval_json
from engine.reporting.per_class import format_per_class_table, report_per_class

# The synthetic classes (ids 1-6) plus one the annotation file lists but no image holds.
NAMES = ["person", "bicycle", "car", "motorcycle", "airplane", "bus", "unicorn"]


@pytest.fixture(scope="module")
def coco_gt(tmp_path_factory) -> COCO:
    tmp = tmp_path_factory.mktemp("per_class")
    root = ensure_synthetic_dataset(tmp / "syn", num_train=1, num_val=20, image_size=64, seed=3)
    data = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    data["categories"].append({"id": 9, "name": "unicorn", "supercategory": "none"})
    path = tmp / "instances.json"
    path.write_text(json.dumps(data))
    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(path))


def ground_truth_detections(coco: COCO, *, drop_category: int | None = None, seed: int | None = None):
    """Each ground-truth box as a detection (xyxy); ``seed``: jittered boxes with random scores."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    predictions = {}
    for image_id in sorted(coco.imgs):
        anns = [a for a in coco.imgToAnns[image_id] if a["category_id"] != drop_category]
        xywh = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        xyxy = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], dim=1)
        scores = torch.ones(len(anns))
        if generator is not None:
            xyxy = xyxy + torch.randn(xyxy.shape, generator=generator) * 3
            scores = torch.rand(len(anns), generator=generator)
        predictions[image_id] = {
            "boxes": xyxy,
            "scores": scores,
            "labels": torch.tensor([a["category_id"] for a in anns], dtype=torch.int64),
        }
    return predictions


def evaluate(coco: COCO, predictions) -> CocoEvaluator:
    evaluator = CocoEvaluator(coco)
    evaluator.update(predictions)
    with contextlib.redirect_stdout(io.StringIO()):
        evaluator.summarize()
    return evaluator


def test_perfect_detections_give_one_and_an_absent_category_none(coco_gt):
    per_class = evaluate(coco_gt, ground_truth_detections(coco_gt)).per_class
    assert list(per_class) == NAMES  # named as in the annotation file, in category id order
    assert per_class["unicorn"] is None
    assert {k: v for k, v in per_class.items() if k != "unicorn"} == pytest.approx({k: 1.0 for k in NAMES[:6]})


def test_a_category_never_detected_gets_zero(coco_gt):
    per_class = evaluate(coco_gt, ground_truth_detections(coco_gt, drop_category=3)).per_class
    assert per_class["car"] == 0.0
    assert all(per_class[name] == pytest.approx(1.0) for name in NAMES[:6] if name != "car")


def test_per_class_figures_average_to_the_summary_ap(coco_gt):
    evaluator = evaluate(coco_gt, ground_truth_detections(coco_gt, seed=4))
    defined = [v for v in evaluator.per_class.values() if v is not None]
    assert len(defined) == 6
    assert max(defined) - min(defined) > 0.05, "the check needs classes that differ"
    assert sum(defined) / len(defined) == pytest.approx(evaluator.stats["AP"], abs=1e-12)


def test_no_detections_give_zero_where_there_is_ground_truth(coco_gt):
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)}
    first = sorted(coco_gt.imgs)[0]
    per_class = evaluate(coco_gt, {first: empty}).per_class
    present = {coco_gt.cats[a["category_id"]]["name"] for a in coco_gt.imgToAnns[first]}
    assert per_class == {name: (0.0 if name in present else None) for name in NAMES}
    assert set(per_class.values()) == {0.0, None}


def test_repeated_category_names_get_their_ids(coco_gt):
    coco = COCO()
    coco.dataset = {
        "images": [],
        "annotations": [],
        "categories": [{"id": 1, "name": "cell"}, {"id": 2, "name": "cell"}, {"id": 5, "name": "nucleus"}],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    assert category_names(coco, [1, 2, 5]) == {1: "cell (id 1)", 2: "cell (id 2)", 5: "nucleus"}


def test_eval_json_holds_per_class_with_null_for_no_ground_truth(tmp_path):
    per_class = {"person": 0.5, "car": 0.0, "unicorn": None}
    write_eval_json(tmp_path / "eval.json", stats={"AP": 0.25}, per_class=per_class, epoch=3)
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written == {"epoch": 3, "AP": 0.25, "per_class": {"person": 0.5, "car": 0.0, "unicorn": None}}
    assert '"unicorn": null' in (tmp_path / "eval.json").read_text()


class RecordingWriter:
    def __init__(self):
        self.added = []

    def add(self, prefix, scalars, step):
        self.added.append((prefix, dict(scalars), step))


def test_log_table_and_tensorboard_scalars(caplog):
    per_class = {"person": 0.51234, "traffic light": 0.0, "unicorn": None}
    table = format_per_class_table(per_class).splitlines()
    assert table[1].split() == ["person", "0.5123"]
    assert table[2].split() == ["traffic", "light", "0.0000"] and table[3].split() == ["unicorn", "-"]
    assert len({line.rfind(" ") + 1 for line in table[1:]}) == 1, "the AP column is aligned"
    writer = RecordingWriter()
    log = logging.getLogger("test_per_class")
    with caplog.at_level(logging.INFO, logger="test_per_class"):
        report_per_class(per_class, writer=writer, step=17, log=log)
    assert writer.added == [("eval_per_class", {"person": 0.51234, "traffic light": 0.0}, 17)]
    assert "AP per category" in caplog.text and "traffic light" in caplog.text
