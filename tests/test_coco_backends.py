"""datasets/cocoeval_backend.py: faster-coco-eval's COCOeval gives pycocotools' figures, and the backend asked for
is the one that runs.

The comparisons skip only where faster-coco-eval is not installed (CI installs it, requirements.txt); the checks of
the setting itself run everywhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO

from datasets import CocoEvaluator, cocoeval_backend, ensure_synthetic_dataset
from datasets.cocoeval_backend import evaluated_cocoeval, faster_coco_eval_installed, resolve_backend
from datasets.per_class_ap import per_class_ap

needs_faster = pytest.mark.skipif(
    not faster_coco_eval_installed(), reason="faster-coco-eval is not installed (pip install faster-coco-eval)"
)
TOLERANCE = 1e-4


def quiet_coco(data: dict) -> COCO:
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


@pytest.fixture(scope="module")
def synthetic_gt(tmp_path_factory) -> COCO:
    root = ensure_synthetic_dataset(
        tmp_path_factory.mktemp("backends") / "syn", num_train=1, num_val=16, image_size=96, seed=1
    )
    return quiet_coco(json.loads((root / "annotations" / "instances_val2017.json").read_text()))


def noisy_ground_truth(coco: COCO, *, per_image: int, seed: int) -> list[dict]:
    """A trained detector's kind of output: each ground-truth box found again, jittered, some with the wrong
    class, then low-scoring boxes anywhere in the image up to ``per_image`` detections."""
    rng = np.random.default_rng(seed)
    category_ids = sorted(coco.getCatIds())
    detections = []
    for image_id in sorted(coco.imgs):
        width, height = coco.imgs[image_id]["width"], coco.imgs[image_id]["height"]
        anns = coco.imgToAnns[image_id]
        for ann in anns:
            x, y, w, h = ann["bbox"]
            box = [
                x + rng.normal(0, 0.08 * w),
                y + rng.normal(0, 0.08 * h),
                w * rng.uniform(0.8, 1.2),
                h * rng.uniform(0.8, 1.2),
            ]
            wrong = rng.random() < 0.2
            detections.append(
                {
                    "image_id": image_id,
                    "bbox": box,
                    "score": float(rng.uniform(0.3, 1.0)),
                    "category_id": int(rng.choice(category_ids)) if wrong else ann["category_id"],
                }
            )
        for _ in range(per_image - len(anns)):
            w, h = rng.uniform(4, width / 2), rng.uniform(4, height / 2)
            detections.append(
                {
                    "image_id": image_id,
                    "category_id": int(rng.choice(category_ids)),
                    "bbox": [rng.uniform(0, width - w), rng.uniform(0, height - h), w, h],
                    "score": float(rng.uniform(0.0, 0.5)),
                }
            )
    return detections


def both_backends(coco: COCO, detections: list[dict], image_ids) -> dict:
    """backend -> (the 12 summary numbers, per-class AP), each from its own COCOeval of the same detections."""
    results = {}
    for backend in ("pycocotools", "faster"):
        with contextlib.redirect_stdout(io.StringIO()):
            coco_eval = evaluated_cocoeval(coco, detections, image_ids=image_ids, backend=backend)
        package = type(coco_eval).__module__.split(".")[0]
        assert package == {"faster": "faster_coco_eval", "pycocotools": "pycocotools"}[backend], package
        assert len(coco_eval.stats) == 12
        results[backend] = ([float(v) for v in coco_eval.stats], per_class_ap(coco_eval))
    return results


def assert_same_figures(results: dict) -> None:
    (reference, reference_per_class), (faster, faster_per_class) = results["pycocotools"], results["faster"]
    assert faster == pytest.approx(reference, abs=TOLERANCE)
    assert list(faster_per_class) == list(reference_per_class)
    for name, ap in reference_per_class.items():
        if ap is None:
            assert faster_per_class[name] is None, name
        else:
            assert faster_per_class[name] == pytest.approx(ap, abs=TOLERANCE), name


@needs_faster
def test_synthetic_set_with_noisy_detections_gives_the_same_figures(synthetic_gt):
    detections = noisy_ground_truth(synthetic_gt, per_image=30, seed=0)
    results = both_backends(synthetic_gt, detections, synthetic_gt.imgs)
    stats, per_class = results["pycocotools"]
    assert 0.05 < stats[0] < 0.95, "an AP strictly between 0 and 1 has room to differ"
    defined = [ap for ap in per_class.values() if ap is not None]
    assert len(defined) >= 3 and len(set(defined)) == len(defined), "per-class figures that differ from each other"
    assert_same_figures(results)


@needs_faster
def test_a_subset_of_images_gives_the_same_figures(synthetic_gt):
    # params.imgIds as CocoEvaluator sets it for a partial pass: ground truth of other images is not scored.
    detections = noisy_ground_truth(synthetic_gt, per_image=10, seed=1)
    subset = sorted(synthetic_gt.imgs)[::3]
    results = both_backends(synthetic_gt, detections, subset)
    assert results["pycocotools"][0] != both_backends(synthetic_gt, detections, synthetic_gt.imgs)["pycocotools"][0]
    assert_same_figures(results)


# A hand-built set: 640x480 images; crowd regions, an image without annotations, one with only a crowd region, a
# category without ground truth, boxes of all three COCO area ranges.
def box(x: float, y: float, w: float, h: float) -> list[float]:
    return [float(x), float(y), float(w), float(h)]


def hand_built_gt() -> COCO:
    images = [{"id": i, "width": 640, "height": 480, "file_name": f"{i}.jpg"} for i in range(1, 7)]
    annotations = [
        # image 1: two people and a crowd of them
        (1, 1, box(10, 10, 60, 120), 0),
        (1, 1, box(100, 40, 50, 100), 0),
        (1, 1, box(300, 200, 300, 250), 1),
        # image 2: nothing at all; image 3: a small, a medium and a large car
        (3, 2, box(5, 5, 20, 20), 0),
        (3, 2, box(100, 100, 70, 60), 0),
        (3, 2, box(200, 150, 300, 300), 0),
        # image 4: a person and a car nobody detects; image 5: only a crowd region
        (4, 1, box(50, 50, 80, 80), 0),
        (4, 2, box(300, 300, 90, 40), 0),
        (5, 2, box(0, 0, 640, 480), 1),
        # image 6: two overlapping people, one of them also in a crowd region
        (6, 1, box(200, 100, 100, 200), 0),
        (6, 1, box(250, 120, 100, 200), 0),
        (6, 1, box(0, 0, 200, 200), 1),
    ]
    anns = [
        {
            "id": n,
            "image_id": image_id,
            "category_id": category_id,
            "bbox": bbox,
            "iscrowd": crowd,
            "area": bbox[2] * bbox[3],
        }
        for n, (image_id, category_id, bbox, crowd) in enumerate(annotations, 1)
    ]
    categories = [{"id": 1, "name": "person"}, {"id": 2, "name": "car"}, {"id": 3, "name": "dog"}]
    return quiet_coco({"images": images, "annotations": anns, "categories": categories})


# Scored above most hits, so that counting it as a false positive would lower the AP.
CROWD_HIT = {"image_id": 1, "category_id": 1, "bbox": box(320, 210, 100, 100), "score": 0.88}


def hand_built_detections() -> list[dict]:
    def det(image_id, category_id, bbox, score):
        return {"image_id": image_id, "category_id": category_id, "bbox": bbox, "score": score}

    return [
        det(1, 1, box(12, 8, 58, 118), 0.9),
        det(1, 1, box(110, 45, 50, 100), 0.6),  # two hits, the second looser
        CROWD_HIT,
        det(1, 1, box(500, 10, 40, 40), 0.5),  # in the crowd region: ignored; and a false positive
        det(2, 1, box(10, 10, 50, 50), 0.8),
        det(2, 2, box(300, 300, 100, 80), 0.4),  # no ground truth here
        det(3, 2, box(6, 4, 19, 22), 0.7),
        det(3, 2, box(110, 100, 70, 60), 0.55),
        det(3, 2, box(210, 160, 290, 300), 0.95),
        det(3, 3, box(0, 0, 30, 30), 0.3),  # a dog, a category with no ground truth anywhere
        det(5, 2, box(100, 100, 200, 200), 0.6),  # inside image 5's crowd region only
        det(6, 1, box(205, 100, 100, 195), 0.85),
        det(6, 1, box(240, 125, 100, 200), 0.45),
        det(6, 1, box(20, 20, 150, 150), 0.65),  # in image 6's crowd region
    ]


@needs_faster
def test_crowds_empty_images_and_detections_without_ground_truth_give_the_same_figures():
    coco = hand_built_gt()
    detections = hand_built_detections()
    results = both_backends(coco, detections, coco.imgs)
    assert_same_figures(results)
    stats, per_class = results["pycocotools"]
    assert per_class["dog"] is None, "no ground truth: no AP, whatever was detected"
    assert 0.2 < stats[0] < 0.9 and stats[3] > -1 and stats[4] > -1 and stats[5] > -1, "every area range is scored"

    # What each case does to the figures, the same in both: a detection on a crowd region changes nothing, ...
    without_crowd_hit = both_backends(coco, [d for d in detections if d is not CROWD_HIT], coco.imgs)
    assert_same_figures(without_crowd_hit)
    assert without_crowd_hit["faster"][0] == pytest.approx(results["faster"][0], abs=TOLERANCE)
    # ... and detections on an image without ground truth are false positives.
    without_image_2 = both_backends(coco, [d for d in detections if d["image_id"] != 2], coco.imgs)
    assert_same_figures(without_image_2)
    assert without_image_2["faster"][0][0] > results["faster"][0][0] + TOLERANCE


@needs_faster
def test_the_evaluator_gives_one_result_whichever_backend(synthetic_gt):
    predictions = {}
    for d in noisy_ground_truth(synthetic_gt, per_image=8, seed=2):
        x, y, w, h = d["bbox"]
        p = predictions.setdefault(d["image_id"], {"boxes": [], "scores": [], "labels": []})
        p["boxes"].append([x, y, x + w, y + h])
        p["scores"].append(d["score"])
        p["labels"].append(d["category_id"])
    predictions = {
        i: {"boxes": torch.tensor(p["boxes"]), "scores": torch.tensor(p["scores"]), "labels": torch.tensor(p["labels"])}
        for i, p in predictions.items()
    }
    evaluators = {}
    for backend in ("pycocotools", "faster"):
        evaluators[backend] = CocoEvaluator(synthetic_gt, backend=backend)
        evaluators[backend].update(predictions)
        evaluators[backend].summarize()
    reference, faster = evaluators["pycocotools"], evaluators["faster"]
    assert 0.05 < reference.stats["AP"] < 0.95
    assert faster.stats == pytest.approx(reference.stats, abs=TOLERANCE)
    assert list(faster.per_class) == list(reference.per_class)
    for name, ap in reference.per_class.items():
        if ap is None:
            assert faster.per_class[name] is None, name
        else:
            assert faster.per_class[name] == pytest.approx(ap, abs=TOLERANCE), name


def test_pycocotools_is_used_when_asked_for(synthetic_gt):
    evaluator = CocoEvaluator(synthetic_gt, backend="pycocotools")
    assert evaluator.backend == "pycocotools"
    evaluator.update(
        {
            1: {
                "boxes": torch.tensor([[1.0, 1.0, 30.0, 30.0]]),
                "scores": torch.tensor([0.5]),
                "labels": torch.tensor([1]),
            }
        }
    )
    evaluator.summarize()
    # pycocotools' own progress line; faster-coco-eval prints "COCOeval_opt.evaluate() finished..." instead.
    assert "Running per image evaluation..." in evaluator.cocoeval_output
    assert "COCOeval_opt" not in evaluator.cocoeval_output


@needs_faster
def test_faster_is_used_when_asked_for_or_auto(synthetic_gt):
    for backend in ("faster", "auto"):
        evaluator = CocoEvaluator(synthetic_gt, backend=backend)
        assert evaluator.backend == "faster", backend
        evaluator.update(
            {
                1: {
                    "boxes": torch.tensor([[1.0, 1.0, 30.0, 30.0]]),
                    "scores": torch.tensor([0.5]),
                    "labels": torch.tensor([1]),
                }
            }
        )
        evaluator.summarize()
        assert "COCOeval_opt.evaluate() finished" in evaluator.cocoeval_output, backend


def test_auto_falls_back_to_pycocotools_and_faster_without_the_package_is_an_error(monkeypatch):
    monkeypatch.setattr(cocoeval_backend, "faster_coco_eval_installed", lambda: False)
    assert resolve_backend("auto") == "pycocotools"
    assert resolve_backend("pycocotools") == "pycocotools"
    with pytest.raises(ValueError, match=r"backend=faster needs the faster-coco-eval package.*pip install"):
        resolve_backend("faster")


@pytest.mark.parametrize("backend", ["fast", "", "PYCOCOTOOLS", None])
def test_an_unknown_backend_is_an_error_naming_the_argument(synthetic_gt, backend):
    expected = re.escape(f"backend must be one of auto, faster, pycocotools, got {backend!r}")
    with pytest.raises(ValueError, match=expected):
        CocoEvaluator(synthetic_gt, backend=backend)
    with pytest.raises(ValueError, match=expected):
        resolve_backend(backend)


def test_no_detections_is_an_error_of_the_function_not_of_the_evaluator(synthetic_gt):
    with pytest.raises(ValueError, match="detections must hold at least one detection"):
        evaluated_cocoeval(synthetic_gt, [], image_ids=synthetic_gt.imgs, backend="pycocotools")
    evaluator = CocoEvaluator(synthetic_gt, backend="pycocotools")
    evaluator.update({1: {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0)}})
    assert evaluator.summarize()["AP"] == 0.0 and evaluator.cocoeval_output == ""
