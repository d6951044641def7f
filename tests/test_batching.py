"""Size buckets and the batch plan (datasets/size_buckets.py, datasets/batch_plan.py, datasets/loader.py).

The buckets must hold every size the recipe can produce, bound the sizes of a run, training and evaluation
together, and pad no more than random batches padded to multiples of 128 did; the plan must give every epoch
the same number of full batches on every process, padded as before (the mask True exactly on padding), and
start a resumed epoch where it stopped without reading the batches before.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from datasets import BatchPlan, build_data_loader, build_dataset, build_size_buckets, ensure_synthetic_dataset
from datasets.batch_plan import epoch_share
from datasets.size_buckets import plan_size_buckets, smallest_holding, unbucketed_waste
from datasets.transforms import make_coco_transforms

COCO_RECIPE = dict(train_limits=(800, 1333 + 2), train_can_turn=True, batch_size=2, max_buckets=8, multiple=32)


def coco_like_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    """(h, w) of photographs as COCO has them: long side 640, mostly 4:3 and 3:2, some square and wide, a
    quarter of them portrait."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(count):
        aspect = rng.choices([4 / 3, 1.5, 1.0, 16 / 9, 1.25, 2.0], [0.45, 0.28, 0.05, 0.07, 0.1, 0.05])[0]
        short = round(640 / aspect)
        sizes.append((short, 640) if rng.random() < 0.75 else (640, short))
    return sizes


@pytest.fixture(scope="module")
def coco_buckets():
    train, val = coco_like_sizes(3000, seed=0), coco_like_sizes(500, seed=1)
    transform = make_coco_transforms(train=True)
    val_transform = make_coco_transforms(train=False)
    val_outputs = [val_transform.plan(s, random.Random(0))[1] for s in val]
    buckets = plan_size_buckets(
        train_sizes=train, plan_train=lambda s, r: transform.plan(s, r)[1], val_outputs=val_outputs, **COCO_RECIPE
    )
    return train, val_outputs, transform, buckets


def test_coco_buckets_hold_every_augmented_size_and_bound_the_sizes_of_a_run(coco_buckets):
    train, val_outputs, transform, buckets = coco_buckets
    assert len(buckets.train) + len(buckets.val) <= 8
    assert set(buckets.families) == {(800, 1344), (1344, 800)}
    rng = random.Random(123)  # fresh draws, not those the buckets were planned on
    for size in train[:1500]:
        out = transform.plan(size, rng)[1]
        assert smallest_holding(out, buckets.train) is not None, out
        assert smallest_holding(out, buckets.families) is not None, out
    assert all(smallest_holding(out, buckets.val) for out in val_outputs)


def test_coco_buckets_pad_less_than_random_batches_padded_to_128(coco_buckets):
    train, _, transform, buckets = coco_buckets
    rng = random.Random(7)
    import numpy as np

    drawn = np.asarray([transform.plan(s, rng)[1] for s in train for _ in range(2)])
    before = unbucketed_waste(drawn, 2, 128, random.Random(0))  # what dataset.pad_to_multiple=128 gave
    plan = BatchPlan(sizes=train, transform=transform, batch_size=2, buckets=buckets, train=True, seed=0)
    for _ in itertools.islice(iter(plan), 2 * plan.steps_per_epoch):
        pass
    assert plan.padding_waste < before, (plan.padding_waste, before)
    assert abs(plan.padding_waste - buckets.expected_waste) < 0.05  # the leftovers in family buckets add little


def _batches(plan: BatchPlan, epochs: int = 1) -> list[list]:
    return list(itertools.islice(iter(plan), epochs * plan.steps_per_epoch))


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_epoch_has_its_steps_in_full_batches_of_one_bucket(coco_buckets, world_size):
    train, _, transform, buckets = coco_buckets
    sizes = train[:301]
    plans = [
        BatchPlan(
            sizes=sizes,
            transform=transform,
            batch_size=4,
            buckets=buckets,
            train=True,
            seed=3,
            rank=rank,
            world_size=world_size,
        )
        for rank in range(world_size)
    ]
    for plan in plans:
        # steps of 4 images per process; two family buckets: up to a step's images but one left in each
        assert plan.steps_per_epoch == 301 // (4 * world_size) - 1
        batches = _batches(plan, epochs=2)
        for epoch in (0, 1):
            seen = [
                s.index
                for batch in batches[epoch * plan.steps_per_epoch : (epoch + 1) * plan.steps_per_epoch]
                for s in batch
            ]
            assert len(seen) == len(set(seen)) or world_size > 1  # no image twice in an epoch (one process)
        for batch in batches:
            assert len(batch) == 4 and len({s.canvas for s in batch}) == 1 and batch[0].canvas in buckets.train
            assert all(s.size[0] <= s.canvas[0] and s.size[1] <= s.canvas[1] for s in batch)
    if world_size == 2:  # the split of DistributedSampler: disjoint shares but for the padding repeat
        first = [set(epoch_share(num_images=301, epoch=0, seed=3, shuffle=True, rank=r, world_size=2)) for r in (0, 1)]
        assert len(first[0] & first[1]) <= 1 and len(first[0] | first[1]) == 301


def test_processes_train_their_parts_of_the_batches_one_process_holding_the_step_would(coco_buckets):
    """Two processes at 4 images each train, step for step, the batches of 8 that one process would: the same images,
    augmented alike and padded to the same size, each process its half."""
    train, _, transform, buckets = coco_buckets
    sizes = train[:301]
    common = dict(sizes=sizes, transform=transform, buckets=buckets, train=True, seed=3)
    one = BatchPlan(**common, batch_size=8)
    two = [BatchPlan(**common, batch_size=4, rank=rank, world_size=2) for rank in (0, 1)]
    assert one.steps_per_epoch == two[0].steps_per_epoch == two[1].steps_per_epoch
    whole, *halves = (_batches(plan, epochs=2) for plan in (one, *two))
    assert len(whole) == 2 * one.steps_per_epoch
    assert all(first + second == batch for batch, first, second in zip(whole, *halves, strict=True))


def test_an_images_augmentation_depends_on_seed_epoch_and_index_only(coco_buckets):
    train, _, transform, buckets = coco_buckets
    sizes = train[:64]
    one = BatchPlan(sizes=sizes, transform=transform, batch_size=2, buckets=buckets, train=True, seed=5)
    two = [
        BatchPlan(
            sizes=sizes, transform=transform, batch_size=2, buckets=buckets, train=True, seed=5, rank=r, world_size=2
        )
        for r in (0, 1)
    ]
    by_index = {s.index: s.plan for b in _batches(one) for s in b}
    for plan in two:
        for batch in _batches(plan):
            for s in batch:
                if s.index in by_index:
                    assert s.plan == by_index[s.index]
    other_seed = BatchPlan(sizes=sizes, transform=transform, batch_size=2, buckets=buckets, train=True, seed=6)
    assert {s.index: s.plan for b in _batches(other_seed) for s in b} != by_index


def test_a_resumed_epoch_starts_at_its_step_and_the_stream_runs_on_into_the_next(coco_buckets):
    train, _, transform, buckets = coco_buckets
    sizes = train[:200]

    def plan():
        return BatchPlan(sizes=sizes, transform=transform, batch_size=2, buckets=buckets, train=True, seed=1)

    full = plan()
    everything = _batches(full, epochs=3)
    k = full.steps_per_epoch
    resumed = plan()
    resumed.start_at(1, 7)
    assert list(itertools.islice(iter(resumed), 2 * k - 7)) == everything[k + 7 :]
    next_epoch = plan()
    next_epoch.start_at(2)
    assert list(itertools.islice(iter(next_epoch), k)) == everything[2 * k :]


def test_evaluation_scores_every_image_once_in_batches_of_one_shape_per_bucket(coco_buckets):
    _, _, _, buckets = coco_buckets
    val_sizes = coco_like_sizes(37, seed=4)
    transform = make_coco_transforms(train=False)
    for world_size in (1, 2):
        seen = []
        for rank in range(world_size):
            plan = BatchPlan(
                sizes=val_sizes,
                transform=transform,
                batch_size=4,
                buckets=buckets,
                train=False,
                rank=rank,
                world_size=world_size,
            )
            batches = list(plan)
            assert len(batches) == len(plan)
            assert all(len(b) == 4 and b[0].canvas in buckets.val for b in batches)  # copies fill the last ones
            seen += [s.index for b in batches for s in b]
        assert set(seen) == set(range(37))


def test_without_buckets_batches_pad_to_their_largest_image(coco_buckets):
    train, _, transform, _ = coco_buckets
    plan = BatchPlan(sizes=train[:50], transform=transform, batch_size=2, buckets=None, train=True, multiple=64)
    assert plan.steps_per_epoch == 25
    for batch in _batches(plan):
        canvas = batch[0].canvas
        assert canvas == tuple(-(-max(s.size[d] for s in batch) // 64) * 64 for d in (0, 1))


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = ensure_synthetic_dataset(
        tmp_path_factory.mktemp("data") / "synthetic", num_train=24, num_val=7, image_size=64, seed=0
    )
    cfg = {
        "name": "coco",
        "root": str(root),
        "train_scales": [48, 56, 64],
        "max_size": 80,
        "val_size": 64,
        "crop": True,
        "crop_scales": [48, 56, 64],
        "crop_min_size": 32,
        "crop_max_size": 56,
    }
    train, val = build_dataset("train", cfg), build_dataset("val", cfg)
    return train, val, build_size_buckets(train, val, cfg, batch_size=2)


@pytest.mark.parametrize("train_split", [True, False])
def test_bucketed_batches_mask_exactly_the_padding_as_before(synthetic, train_split):
    """The image at the top left of its bucket, zeros and mask True on the rest, boxes relative to the image."""
    train, val, buckets = synthetic
    dataset = train if train_split else val
    loader = build_data_loader(dataset, batch_size=2, num_workers=0, train=train_split, buckets=buckets, seed=0)
    count = loader.batch_sampler.steps_per_epoch if train_split else len(loader.batch_sampler)
    sizes = buckets.train if train_split else buckets.val
    for images, masks, targets in itertools.islice(loader, count):
        assert tuple(images.shape[-2:]) in sizes
        for image, mask, target in zip(images, masks, targets):
            h, w = target["size"].tolist()
            assert not mask[:h, :w].any() and mask.sum() == mask.numel() - h * w
            assert (image[:, mask] == 0).all()
            boxes = target["boxes"]
            assert ((boxes >= 0) & (boxes <= 1)).all()


def test_a_planned_sample_comes_out_at_its_planned_size(synthetic):
    train, _, buckets = synthetic
    plan = BatchPlan(
        sizes=[train.image_size(i) for i in range(len(train))],
        transform=train.transforms,
        batch_size=2,
        buckets=buckets,
        train=True,
        seed=2,
    )
    for batch in _batches(plan):
        for sample in batch:
            image, target, canvas = train[sample]
            assert tuple(image.shape[-2:]) == sample.size == tuple(target["size"].tolist())
            assert canvas == sample.canvas


def test_too_few_buckets_for_the_data_is_a_clear_error(synthetic):
    train, val, _ = synthetic
    cfg = {"name": "coco", "root": str(train.image_dir.parent), "crop": True, "size_buckets": 3}
    with pytest.raises(
        ValueError,
        match=r"dataset\.size_buckets=3 is too few for this data: it needs 2 training and "
        r"2 evaluation sizes",
    ):
        build_size_buckets(train, val, cfg, batch_size=2)


def test_the_stream_prefetches_across_an_epochs_end(synthetic):
    """One iterator for every epoch: its workers keep reading when an epoch ends, so the next one starts with
    batches ready (no new iterator, no worker start at an epoch's start)."""
    train, _, buckets = synthetic
    loader = build_data_loader(train, batch_size=2, num_workers=1, train=True, buckets=buckets, seed=0)
    starts = []
    iter_of = type(loader.batch_sampler).__iter__

    def counting(self):
        starts.append(1)
        return iter_of(self)

    type(loader.batch_sampler).__iter__ = counting
    try:
        stream = iter(loader)
        at_start = len(starts)  # DataLoader's iterator asks for its sampler's iterator as it is made
        batches = [next(stream) for _ in range(3 * loader.batch_sampler.steps_per_epoch)]
    finally:
        type(loader.batch_sampler).__iter__ = iter_of
    assert len(starts) == at_start and len(batches) == 3 * loader.batch_sampler.steps_per_epoch
    del stream


def test_buckets_stay_within_max_size_when_no_image_can_come_out_longer(tmp_path):
    """96 x 96 images at max_size=128: no augmented size exceeds 128 (a capped long side comes out longer only for
    aspect ratios of 2 and more), so no bucket may either (it was 96 x 160)."""
    import json

    import numpy as np
    from hydra import compose, initialize_config_dir
    from PIL import Image

    for split, count in (("train", 24), ("val", 4)):
        (tmp_path / split).mkdir()
        images = [{"id": i + 1, "file_name": f"{i}.jpg", "width": 96, "height": 96} for i in range(count)]
        for image in images:
            Image.fromarray(np.full((96, 96, 3), 128, np.uint8)).save(tmp_path / split / image["file_name"])
        annotations = [
            {"id": i["id"], "image_id": i["id"], "category_id": 1, "bbox": [10, 10, 30, 30], "area": 900, "iscrowd": 0}
            for i in images
        ]
        (tmp_path / f"{split}.json").write_text(
            json.dumps({"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "thing"}]})
        )
    configs = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                "dataset=custom",
                *(f"dataset.{s}_images={tmp_path / s}" for s in ("train", "val")),
                *(f"dataset.{s}_annotations={tmp_path / s}.json" for s in ("train", "val")),
                "dataset.max_size=128",
                "dataset.val_size=96",
                "dataset.train_scales=[64,96]",
            ],
        )
    train, val = (build_dataset(split, cfg.dataset, check=False) for split in ("train", "val"))
    buckets = build_size_buckets(train, val, cfg.dataset, batch_size=2, seed=0)
    assert max(side for size in (*buckets.train, *buckets.val) for side in size) <= 128, buckets.describe()
    rng = random.Random(1)
    for _ in range(200):  # every augmented size still has its bucket
        assert smallest_holding(train.transforms.plan((96, 96), rng)[1], buckets.train) is not None
