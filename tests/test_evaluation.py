"""datasets/evaluation.py: COCOeval bbox AP on the synthetic set, single process and over 2 gloo ranks."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pycocotools.coco import COCO

from datasets import CocoEvaluator, ensure_synthetic_dataset
from datasets.evaluation import STAT_NAMES
from engine.runtime.distributed import DistContext, Ranks


@pytest.fixture(scope="module")
def coco_gt(tmp_path_factory) -> COCO:
    root = ensure_synthetic_dataset(
        tmp_path_factory.mktemp("data") / "syn", num_train=1, num_val=24, image_size=96, seed=0
    )
    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(root / "annotations" / "instances_val2017.json"))


def ground_truth_predictions(coco: COCO, *, shift: float = 0.0) -> dict[int, dict[str, torch.Tensor]]:
    """Every ground-truth box as a detection of score 1, moved right by ``shift`` box widths (xyxy)."""
    predictions = {}
    for image_id in sorted(coco.imgs):
        anns = coco.imgToAnns[image_id]
        xywh = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        xyxy = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], dim=1)
        xyxy[:, 0::2] += shift * xywh[:, 2:3]
        predictions[image_id] = {
            "boxes": xyxy,
            "scores": torch.ones(len(anns)),
            "labels": torch.tensor([a["category_id"] for a in anns], dtype=torch.int64),
        }
    return predictions


def noisy_predictions(coco: COCO, *, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Jittered ground truth with random scores and some wrong labels: AP strictly between 0 and 1."""
    generator = torch.Generator().manual_seed(seed)
    predictions = ground_truth_predictions(coco)
    for prediction in predictions.values():
        n = prediction["boxes"].shape[0]
        prediction["boxes"] = prediction["boxes"] + torch.randn(n, 4, generator=generator) * 4
        prediction["scores"] = torch.rand(n, generator=generator)
        wrong = torch.rand(n, generator=generator) < 0.3
        prediction["labels"] = torch.where(wrong, torch.full_like(prediction["labels"], 5), prediction["labels"])
    return predictions


def evaluate(coco: COCO, *updates: dict) -> dict[str, float]:
    evaluator = CocoEvaluator(coco)
    for predictions in updates:
        evaluator.update(predictions)
    with contextlib.redirect_stdout(io.StringIO()):
        return evaluator.summarize()


def test_ground_truth_as_detections_gives_ap_one(coco_gt):
    stats = evaluate(coco_gt, ground_truth_predictions(coco_gt))
    assert set(stats) == set(STAT_NAMES)
    for name in ("AP", "AP50", "AP75"):
        assert stats[name] == pytest.approx(1.0, abs=1e-6), name
    assert all(isinstance(v, float) for v in stats.values())


def test_shifted_boxes_give_lower_ap(coco_gt):
    # A shift of s box widths leaves IoU (1 - s) / (1 + s): 0.90, 0.74, 0.43 for the shifts below.
    aps = [evaluate(coco_gt, ground_truth_predictions(coco_gt, shift=shift))["AP"] for shift in (0.0, 0.05, 0.15, 0.4)]
    assert aps[0] == pytest.approx(1.0)
    assert aps[0] > aps[1] > aps[2] > aps[3], aps
    assert aps[3] == 0.0, "IoU 0.43 matches at no COCO threshold"


@pytest.mark.parametrize("with_updates", [True, False])
def test_zero_detections_give_zero_without_crashing(coco_gt, with_updates):
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)}
    updates = [{image_id: empty for image_id in coco_gt.imgs}] if with_updates else []
    assert evaluate(coco_gt, *updates) == {name: 0.0 for name in STAT_NAMES}


def test_images_without_detections_count_as_missed(coco_gt):
    predictions = ground_truth_predictions(coco_gt)
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)}
    half = sorted(predictions)[: len(predictions) // 2]
    stats = evaluate(coco_gt, {i: (predictions[i] if i in half else empty) for i in predictions})
    assert 0.2 < stats["AP"] < 0.8


def test_only_updated_images_are_scored(coco_gt):
    # A partial pass (max_steps, a subset of the val set) is scored on the images it saw.
    predictions = ground_truth_predictions(coco_gt)
    subset = {i: predictions[i] for i in sorted(predictions)[:5]}
    assert evaluate(coco_gt, subset)["AP"] == pytest.approx(1.0)


def test_split_updates_merge_to_the_same_result(coco_gt):
    predictions = noisy_predictions(coco_gt, seed=0)
    ids = sorted(predictions)
    whole = evaluate(coco_gt, predictions)
    assert 0.05 < whole["AP"] < 0.95, "the check needs an AP that can differ"
    parts = [
        {i: predictions[i] for i in ids[0::2]},
        {i: predictions[i] for i in ids[1::2]},
        {ids[0]: predictions[ids[0]]},
    ]
    assert evaluate(coco_gt, *parts) == whole  # the repeated image (as a padded sampler gives) counts once
    assert evaluate(coco_gt, parts[0])["AP"] != whole["AP"], "the halves alone differ"


def test_save_detections_writes_coco_results_in_xywh(coco_gt, tmp_path):
    evaluator = CocoEvaluator(coco_gt)
    evaluator.update(ground_truth_predictions(coco_gt))
    evaluator.save_detections(tmp_path / "eval" / "detections.json")
    saved = json.loads((tmp_path / "eval" / "detections.json").read_text())
    expected = sorted((a["image_id"], a["category_id"], a["bbox"]) for a in coco_gt.dataset["annotations"])
    got = sorted((d["image_id"], d["category_id"], d["bbox"]) for d in saved)
    assert got == expected
    assert all(d["score"] == 1.0 for d in saved)


def test_unknown_image_id_is_an_error(coco_gt):
    with pytest.raises(KeyError, match="123456"):
        CocoEvaluator(coco_gt).update({123456: ground_truth_predictions(coco_gt)[1]})


def _rank_main(rank: int, world_size: int, store: str, annotation_file: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(annotation_file)
        predictions = noisy_predictions(coco, seed=0)
        ids = sorted(predictions)
        # Rank r sees every other image, plus the first one again (DistributedSampler's padding).
        mine = ids[rank::world_size] + [ids[0]]
        ctx = DistContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
        evaluator = CocoEvaluator(coco, ranks=Ranks(ctx))
        evaluator.update({i: predictions[i] for i in mine})
        with contextlib.redirect_stdout(io.StringIO()):
            stats = evaluator.summarize()
        queue.put((rank, stats, evaluator.per_class, len(evaluator.detections)))
    finally:
        dist.destroy_process_group()


def test_gather_over_two_ranks_equals_one_process(coco_gt, tmp_path):
    annotation_file = tmp_path / "instances.json"
    annotation_file.write_text(json.dumps(coco_gt.dataset))
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(_rank_main, args=(2, str(tmp_path / "store"), str(annotation_file), queue), nprocs=2)
    results = sorted(queue.get() for _ in range(2))
    single = CocoEvaluator(coco_gt)
    single.update(noisy_predictions(coco_gt, seed=0))
    with contextlib.redirect_stdout(io.StringIO()):
        whole = single.summarize()
    total = len(coco_gt.dataset["annotations"])
    for rank, stats, per_class, detections in results:
        assert stats == whole, f"rank {rank}"
        assert per_class == single.per_class, f"rank {rank} has rank 0's per-class AP"
        assert detections == total, f"rank {rank} holds every image's detections once"
