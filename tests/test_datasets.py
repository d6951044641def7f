"""datasets/: the synthetic set, COCO loading, the augmentations, collation and the loader (CPU, fast)."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from pycocotools.coco import COCO
from torchvision import tv_tensors

from datasets import (
    CocoDetection,
    build_data_loader,
    build_dataset,
    collate_fn,
    ensure_synthetic_dataset,
    make_coco_transforms,
    synthetic,
)
from datasets.loader import PACK_TARGETS, BatchTargets
from datasets.transforms import (
    Finalize,
    RandomHorizontalFlip,
    RandomResize,
    RandomSizeCrop,
    crop,
    size_with_aspect_ratio,
)

SMALL = dict(num_train=10, num_val=6, image_size=64, seed=0)
SMALL_TRANSFORMS = dict(
    train_scales=[48, 56, 64],
    max_size=80,
    val_size=64,
    crop=True,
    crop_scales=[48, 56, 64],
    crop_min_size=32,
    crop_max_size=56,
)


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny tensors: intra-op threads only add contention on a shared CPU (25x slower measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory) -> Path:
    return ensure_synthetic_dataset(tmp_path_factory.mktemp("data") / "synthetic", **SMALL)


def load_coco(path: Path) -> COCO:
    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(str(path))


def make_sample(*, height: int, width: int, boxes: list[list[float]], labels: list[int] | None = None):
    """A uint8 image with a gradient (so flips and crops are visible) and its XYXY target."""
    image = tv_tensors.Image(torch.arange(3 * height * width, dtype=torch.int64).reshape(3, height, width) % 251)
    image = tv_tensors.wrap(image.to(torch.uint8), like=image)
    boxes_t = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
    n = boxes_t.shape[0]
    target = {
        "boxes": tv_tensors.BoundingBoxes(boxes_t, format="XYXY", canvas_size=(height, width)),
        "labels": torch.tensor(labels if labels is not None else list(range(1, n + 1)), dtype=torch.int64),
        "area": (boxes_t[:, 2] - boxes_t[:, 0]) * (boxes_t[:, 3] - boxes_t[:, 1]),
        "iscrowd": torch.zeros(n, dtype=torch.int64),
        "image_id": torch.tensor(1),
        "orig_size": torch.tensor([height, width]),
    }
    return image, target


# --------------------------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize("split", ["train", "val"])
def test_synthetic_set_loads_through_pycocotools_with_valid_boxes(synthetic_root, split):
    coco = load_coco(synthetic_root / "annotations" / f"instances_{split}2017.json")
    assert len(coco.imgs) == SMALL[f"num_{split}"]
    category_ids = set(coco.cats)
    assert category_ids <= set(range(1, 91)), "ids must be valid COCO category ids (num_classes=91)"
    shapes = set()
    for image_id, info in coco.imgs.items():
        path = synthetic_root / f"{split}2017" / info["file_name"]
        assert path.is_file()
        shapes.add((info["height"], info["width"]))
        assert max(info["height"], info["width"]) == SMALL["image_size"]
        anns = coco.imgToAnns[image_id]
        assert 1 <= len(anns) <= synthetic.MAX_OBJECTS
        assert len({a["category_id"] for a in anns}) == len(anns), "classes within an image are distinct"
        for a in anns:
            x, y, w, h = a["bbox"]
            assert w > 0 and h > 0 and a["area"] > 0
            assert x >= 0 and y >= 0 and x + w <= info["width"] and y + h <= info["height"]
            assert min(w / info["width"], h / info["height"]) >= 0.1, "objects are not tiny"
            assert a["category_id"] in category_ids and a["iscrowd"] == 0
    assert len(shapes) > 1, "image sizes vary, so batches need padding"


def test_synthetic_objects_sometimes_overlap(synthetic_root):
    coco = load_coco(synthetic_root / "annotations" / "instances_train2017.json")
    overlapping = 0
    for anns in coco.imgToAnns.values():
        for i, a in enumerate(anns):
            for b in anns[i + 1 :]:
                (ax, ay, aw, ah), (bx, by, bw, bh) = a["bbox"], b["bbox"]
                overlapping += min(ax + aw, bx + bw) > max(ax, bx) and min(ay + ah, by + bh) > max(ay, by)
    assert overlapping > 0


def test_synthetic_set_is_deterministic_from_the_seed(tmp_path):
    a = ensure_synthetic_dataset(tmp_path / "a", **SMALL)
    b = ensure_synthetic_dataset(tmp_path / "b", **SMALL)
    c = ensure_synthetic_dataset(tmp_path / "c", **{**SMALL, "seed": 1})
    for split in ("train", "val"):
        name = f"annotations/instances_{split}2017.json"
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() != (c / name).read_bytes()
        for image in sorted((a / f"{split}2017").iterdir()):
            assert image.read_bytes() == (b / f"{split}2017" / image.name).read_bytes()


def test_ensure_synthetic_reuses_regenerates_and_protects(tmp_path, monkeypatch):
    root = ensure_synthetic_dataset(tmp_path / "syn", **SMALL)
    sentinel = root / "sentinel"
    sentinel.write_text("kept while the parameters match")
    with monkeypatch.context() as patch:
        patch.setattr(synthetic, "write_split", lambda *a, **k: pytest.fail("regenerated a matching set"))
        ensure_synthetic_dataset(root, **SMALL)
    assert sentinel.exists(), "same parameters must reuse the set on disk"
    ensure_synthetic_dataset(root, **{**SMALL, "num_train": 3})
    assert not sentinel.exists(), "other parameters must regenerate the set"
    assert len(list((root / "train2017").iterdir())) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging/old leftovers"
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("not a synthetic set")
    with pytest.raises(FileExistsError, match="mine"):
        ensure_synthetic_dataset(foreign, **SMALL)
    assert (foreign / "precious.txt").exists()


def test_interrupted_generation_leaves_no_half_set(tmp_path, monkeypatch):
    def write_then_die(root, *, split, **kwargs):
        (root / f"{split}2017").mkdir(parents=True)
        raise KeyboardInterrupt  # as if the run were killed half way

    monkeypatch.setattr(synthetic, "write_split", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        ensure_synthetic_dataset(tmp_path / "syn", **SMALL)
    assert not (tmp_path / "syn").exists()
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------- loading


def test_dataset_targets_match_annotations_without_augmentation(synthetic_root):
    cfg = {"name": "synthetic", "root": str(synthetic_root), **SMALL, **SMALL_TRANSFORMS}
    dataset = build_dataset("val", cfg)
    coco = dataset.coco
    assert len(dataset) == SMALL["num_val"]
    for index in range(len(dataset)):
        image, target = dataset[index]
        info = coco.imgs[int(target["image_id"])]
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        assert image.shape[1:] == tuple(target["size"].tolist())
        assert target["orig_size"].tolist() == [info["height"], info["width"]]
        expected = size_with_aspect_ratio(
            height=info["height"],
            width=info["width"],
            size=SMALL_TRANSFORMS["val_size"],
            max_size=SMALL_TRANSFORMS["max_size"],
        )
        assert tuple(image.shape[1:]) == expected
        anns = coco.imgToAnns[info["id"]]
        assert target["labels"].tolist() == [a["category_id"] for a in anns]
        assert target["labels"].dtype == torch.int64 and target["boxes"].dtype == torch.float32
        # Normalized cxcywh -> absolute xywh in the original image equals the annotation.
        h, w = info["height"], info["width"]
        cx, cy, bw, bh = target["boxes"].unbind(-1)
        xywh = torch.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, bw * w, bh * h], -1)
        torch.testing.assert_close(xywh, torch.tensor([a["bbox"] for a in anns]), atol=1e-3, rtol=0)


def write_coco(root: Path, *, split: str, images: list[dict], annotations: list[dict]) -> None:
    (root / f"{split}2017").mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    data = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": 1, "name": "a"}, {"id": 7, "name": "b"}],
    }
    (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps(data))


def test_crowd_and_degenerate_boxes_are_dropped_and_boxes_clamped(tmp_path):
    from PIL import Image

    write_coco(
        tmp_path,
        split="val",
        images=[{"id": 5, "file_name": "x.jpg", "height": 40, "width": 60}],
        annotations=[
            {"id": 1, "image_id": 5, "category_id": 1, "bbox": [10, 10, 20, 10], "area": 150.0, "iscrowd": 0},
            {"id": 2, "image_id": 5, "category_id": 7, "bbox": [0, 0, 30, 30], "area": 900.0, "iscrowd": 1},
            {"id": 3, "image_id": 5, "category_id": 7, "bbox": [5, 5, 0, 10], "area": 0.0, "iscrowd": 0},
            {"id": 4, "image_id": 5, "category_id": 7, "bbox": [50, 30, 20, 20], "area": 400.0, "iscrowd": 0},
        ],
    )
    Image.new("RGB", (60, 40)).save(tmp_path / "val2017" / "x.jpg")
    dataset = CocoDetection(
        image_dir=tmp_path / "val2017", annotation_file=tmp_path / "annotations" / "instances_val2017.json"
    )
    _, target = dataset[0]
    assert target["labels"].tolist() == [1, 7]
    assert target["boxes"].tolist() == [[10, 10, 30, 20], [50, 30, 60, 40]]  # the last clamped to 60x40
    assert target["area"].tolist() == [150.0, 400.0]
    assert target["image_id"].item() == 5 and target["orig_size"].tolist() == [40, 60]


@pytest.mark.parametrize("missing", ["annotation", "images"])
def test_missing_files_raise_file_not_found_naming_the_path(synthetic_root, tmp_path, missing):
    root = tmp_path / "coco"
    shutil.copytree(synthetic_root, root)
    path = root / "annotations" / "instances_train2017.json" if missing == "annotation" else root / "train2017"
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(FileNotFoundError) as error:
        build_dataset("train", {"name": "coco", "root": str(root)})
    assert str(path) in str(error.value) and "instances_val2017.json" in str(error.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_image_raises_naming_the_file(synthetic_root, tmp_path, damage):
    root = tmp_path / "coco"
    shutil.copytree(synthetic_root, root)
    dataset = build_dataset("val", {"name": "coco", "root": str(root), **SMALL_TRANSFORMS})
    path = root / "val2017" / dataset.coco.imgs[dataset.ids[2]]["file_name"]
    data = path.read_bytes()
    path.write_bytes({"garbage": b"not a jpeg at all" * 10, "truncated": data[: len(data) // 3], "empty": b""}[damage])
    dataset[1]  # the other images still load
    with pytest.raises(OSError) as error:
        dataset[2]
    assert str(path) in str(error.value)


def test_build_dataset_rejects_unknown_names_and_splits(synthetic_root):
    with pytest.raises(ValueError, match=re.escape("dataset.name")):
        build_dataset("train", {"name": "voc", "root": str(synthetic_root)})
    with pytest.raises(ValueError, match="split"):
        build_dataset("test", {"name": "coco", "root": str(synthetic_root)})


# -------------------------------------------------------------------------------------------- transforms

BOXES = [[0.0, 0.0, 10.0, 10.0], [12.5, 3.0, 40.0, 29.0], [30.0, 20.0, 50.0, 30.0]]


@pytest.mark.parametrize("height,width", [(30, 50), (31, 64), (64, 64)])
def test_flip_twice_is_identity_and_once_mirrors(height, width):
    image, target = make_sample(height=height, width=width, boxes=BOXES)
    flip = RandomHorizontalFlip(p=1.0)
    once_image, once = flip(image, target)
    expected = torch.tensor(BOXES)[:, [2, 1, 0, 3]] * torch.tensor([-1, 1, -1, 1]) + torch.tensor([width, 0, width, 0])
    torch.testing.assert_close(once["boxes"].as_subclass(torch.Tensor), expected)
    torch.testing.assert_close(once_image, image.flip(-1))
    twice_image, twice = flip(once_image, once)
    torch.testing.assert_close(twice["boxes"].as_subclass(torch.Tensor), target["boxes"].as_subclass(torch.Tensor))
    torch.testing.assert_close(twice_image, image)
    assert torch.equal(twice["labels"], target["labels"])


@pytest.mark.parametrize(
    "height,width,size,max_size,expected",
    [
        (480, 640, 800, 1333, (800, 1066)),  # short side to size, long side floored
        (640, 480, 800, 1333, (1066, 800)),  # portrait
        (480, 640, 800, 1000, (750, 1000)),  # long side capped: short side becomes round(1000*480/640)
        (500, 500, 800, 1333, (800, 800)),
        (800, 1000, 800, 1333, (800, 1000)),  # already the right size: unchanged
        (427, 640, 480, None, (480, 719)),
    ],
)
def test_size_with_aspect_ratio_matches_the_original_arithmetic(height, width, size, max_size, expected):
    assert size_with_aspect_ratio(height=height, width=width, size=size, max_size=max_size) == expected


@pytest.mark.parametrize("height,width,size,max_size", [(30, 50, 60, None), (50, 30, 20, 100), (40, 64, 48, 60)])
def test_resize_scales_boxes_by_the_resize_factor(height, width, size, max_size):
    image, target = make_sample(height=height, width=width, boxes=BOXES)
    out_image, out = RandomResize(sizes=[size], max_size=max_size)(image, target)
    new_h, new_w = size_with_aspect_ratio(height=height, width=width, size=size, max_size=max_size)
    assert tuple(out_image.shape) == (3, new_h, new_w)
    scale = torch.tensor([new_w / width, new_h / height, new_w / width, new_h / height])
    torch.testing.assert_close(out["boxes"].as_subclass(torch.Tensor), torch.tensor(BOXES) * scale)
    torch.testing.assert_close(out["area"], target["area"] * scale[0] * scale[1])
    assert tuple(out["boxes"].canvas_size) == (new_h, new_w)


@pytest.mark.parametrize(
    "window,expected_boxes,expected_labels",
    [
        # window (top, left, height, width); box 1 falls outside, box 2 is clipped, box 3 inside
        ((5, 20, 25, 30), [[0.0, 0.0, 20.0, 24.0], [10.0, 15.0, 30.0, 25.0]], [2, 3]),
        ((0, 0, 12, 12), [[0.0, 0.0, 10.0, 10.0]], [1]),  # box 2 clipped to zero width: dropped
        ((31, 0, 9, 10), [], []),  # below every box: all dropped
    ],
)
def test_crop_clips_and_drops_boxes(window, expected_boxes, expected_labels):
    image, target = make_sample(height=40, width=60, boxes=BOXES)
    top, left, height, width = window
    out_image, out = crop(image, target, top=top, left=left, height=height, width=width)
    torch.testing.assert_close(out_image, image[:, top : top + height, left : left + width])
    torch.testing.assert_close(out["boxes"].as_subclass(torch.Tensor), torch.tensor(expected_boxes).reshape(-1, 4))
    assert out["labels"].tolist() == expected_labels
    assert out["iscrowd"].shape == out["area"].shape == (len(expected_labels),)
    boxes = torch.tensor(expected_boxes).reshape(-1, 4)
    torch.testing.assert_close(out["area"], (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]))


@pytest.mark.parametrize("seed", range(4))
def test_random_size_crop_stays_inside_bounds(seed):
    torch.manual_seed(seed)
    image, target = make_sample(height=40, width=60, boxes=BOXES)
    out_image, out = RandomSizeCrop(min_size=20, max_size=35)(image, target)
    height, width = out_image.shape[-2:]
    assert 20 <= height <= 35 and 20 <= width <= 35
    boxes = out["boxes"]
    assert tuple(boxes.canvas_size) == (height, width)
    assert ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all()
    assert (boxes[:, 0::2] >= 0).all() and (boxes[:, 0::2] <= width).all() and (boxes[:, 1::2] <= height).all()


def test_finalize_keeps_the_pixels_and_gives_normalized_cxcywh():
    image, target = make_sample(height=20, width=40, boxes=[[10.0, 5.0, 30.0, 15.0]])
    image = tv_tensors.Image(torch.randint(0, 256, (3, 20, 40), dtype=torch.uint8))
    out_image, out = Finalize()(image, target)
    assert type(out_image) is torch.Tensor and out_image.dtype == torch.uint8
    assert torch.equal(out_image, image.as_subclass(torch.Tensor))
    with pytest.raises(ValueError, match=re.escape("Finalize takes uint8 pixels, got torch.float32")):
        Finalize()(tv_tensors.Image(image.float()), target)
    assert type(out["boxes"]) is torch.Tensor
    torch.testing.assert_close(out["boxes"], torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    assert out["size"].tolist() == [20, 40]


@pytest.mark.parametrize("seed", range(6))
def test_train_pipeline_keeps_boxes_consistent(synthetic_root, seed):
    torch.manual_seed(seed)
    dataset = build_dataset("train", {"name": "coco", "root": str(synthetic_root), **SMALL_TRANSFORMS})
    image, target = dataset[seed % len(dataset)]
    assert image.shape[1:] == tuple(target["size"].tolist())
    short, long = min(image.shape[1:]), max(image.shape[1:])
    # Last step is RandomResize(train_scales, max_size): a scale on the short side, or the long side
    # at the cap (give or take the original's rounding).
    assert short in SMALL_TRANSFORMS["train_scales"] or abs(long - SMALL_TRANSFORMS["max_size"]) <= long / short
    assert long <= SMALL_TRANSFORMS["max_size"] + long / short
    boxes = target["boxes"]
    n = boxes.shape[0]
    assert target["labels"].shape == target["area"].shape == target["iscrowd"].shape == (n,)
    assert ((boxes >= 0) & (boxes <= 1)).all() and (boxes[:, 2:] > 0).all()
    assert (boxes[:, :2] - boxes[:, 2:] / 2 >= -1e-5).all() and (boxes[:, :2] + boxes[:, 2:] / 2 <= 1 + 1e-5).all()


def test_validation_transform_is_deterministic(synthetic_root):
    dataset = build_dataset("val", {"name": "coco", "root": str(synthetic_root), **SMALL_TRANSFORMS})
    torch.manual_seed(0)
    first = dataset[0]
    torch.manual_seed(1)
    second = dataset[0]
    assert torch.equal(first[0], second[0]) and torch.equal(first[1]["boxes"], second[1]["boxes"])


def test_make_coco_transforms_defaults_are_the_published_recipe():
    image, target = make_sample(height=480, width=640, boxes=BOXES)
    out_image, _ = make_coco_transforms(train=False)(image, target)
    assert tuple(out_image.shape[1:]) == (800, 1066)


# ------------------------------------------------------------------------------------- collate and loader


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_collate_pads_with_zeros_and_masks_the_padding(dtype):
    a = torch.randint(1, 256, (3, 4, 5)).to(dtype)  # strictly positive, so padding zeros are recognizable
    b = torch.randint(1, 256, (3, 6, 2)).to(dtype)
    images, masks, targets = collate_fn([(a, {"id": 0}), (b, {"id": 1})])
    assert images.shape == (2, 3, 6, 5) and images.dtype == dtype
    assert masks.shape == (2, 6, 5) and masks.dtype == torch.bool
    assert torch.equal(images[0, :, :4, :5], a) and torch.equal(images[1, :, :6, :2], b)
    expected_masks = torch.ones(2, 6, 5, dtype=torch.bool)
    expected_masks[0, :4, :5] = False
    expected_masks[1, :6, :2] = False
    assert torch.equal(masks, expected_masks)
    assert (images[masks[:, None].expand_as(images)] == 0).all()
    assert [t["id"] for t in targets] == [0, 1]


def test_collate_pads_to_a_multiple_when_asked():
    a, b = torch.rand(3, 33, 5) + 1, torch.rand(3, 6, 65) + 1
    images, masks, _ = collate_fn([(a, {}), (b, {})], pad_to_multiple=32)
    assert images.shape == (2, 3, 64, 96) and masks.shape == (2, 64, 96)
    assert torch.equal(images[0, :, :33, :5], a) and not masks[0, :33, :5].any() and masks[0, 33:].all()
    assert masks[1, :, 65:].all() and masks[1, 6:].all() and (images[masks[:, None].expand_as(images)] == 0).all()
    same, _, _ = collate_fn([(a, {}), (b, {})])
    assert same.shape == (2, 3, 33, 65)  # the default pads to the largest image only, as the original


class _Items(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def _same_target(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert type(got[key]) is type(value), key
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_a_batchs_targets_cross_from_a_worker_as_one_tensor_per_key_and_read_as_the_images_dicts():
    generator = torch.Generator().manual_seed(7)
    targets = []
    for i, n in enumerate([3, 0, 5, 1]):  # an image without boxes among them
        targets.append(
            {
                "boxes": torch.rand(n, 4, generator=generator),
                "labels": torch.randint(0, 80, (n,), generator=generator),
                "image_id": torch.tensor(100 + i),
                "size": torch.tensor([48 + i, 64]),
                # per image: another dtype in one image, a subclass, not a tensor
                "score": torch.rand(n, dtype=torch.float64 if i == 2 else torch.float32, generator=generator),
                "canvas": tv_tensors.BoundingBoxes(
                    torch.rand(1, 4, generator=generator), format="XYXY", canvas_size=(8, 8)
                ),
                "file": f"{i}.jpg",
            }
        )
    items = [(torch.rand(3, 6, 5, generator=generator), t) for t in targets]
    loader = torch.utils.data.DataLoader(_Items(items), batch_size=4, num_workers=1, collate_fn=collate_fn)
    [(_, _, got)] = list(loader)
    assert isinstance(got, BatchTargets) and len(got) == 4
    for g, want in zip(got, targets):
        _same_target(g, want)
    assert len(got.tensors()) == 4 + 2 * 4  # boxes, labels, image_id, size packed; score and canvas per image
    again = pickle.loads(pickle.dumps(got))  # what a worker sends, without the views
    moved = got.to(torch.device("cpu"))
    for g, h, want in zip(again, moved, targets):
        _same_target(g, want)
        _same_target(h, want)
    assert BatchTargets([]) == [] and BatchTargets([{"id": 0}, {"other": 1}]) == [{"id": 0}, {"other": 1}]


def test_this_torch_pins_packed_targets_through_their_method():
    # Else collate_fn leaves the targets per image (a torch that pins a list item by item would unpin them).
    assert PACK_TARGETS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_a_gpu_runs_loader_pins_the_packed_targets_in_its_pin_memory_thread(synthetic_root):
    from engine.runtime.console import PIN_MEMORY_THREAD

    dataset = build_dataset("train", {"name": "coco", "root": str(synthetic_root), **SMALL_TRANSFORMS})
    loader = build_data_loader(dataset, batch_size=4, num_workers=1, train=True, seed=0, pin_memory=True)
    batches = iter(loader)
    images, masks, targets = next(batches)
    assert PIN_MEMORY_THREAD in batches._pin_memory_thread.name  # what engine.runtime.console recognizes
    assert isinstance(targets, BatchTargets) and images.is_pinned() and masks.is_pinned()
    assert all(t.is_pinned() for t in targets.tensors())
    assert all(target["boxes"].is_pinned() and target["labels"].is_pinned() for target in targets)
    batches._shutdown_workers()


@pytest.mark.parametrize("train,batch_size,expected_batches", [(True, 4, 2), (False, 4, 2), (False, 6, 1)])
def test_data_loader_yields_padded_batches(synthetic_root, train, batch_size, expected_batches):
    split = "train" if train else "val"
    dataset = build_dataset(split, {"name": "coco", "root": str(synthetic_root), **SMALL_TRANSFORMS})
    loader = build_data_loader(dataset, batch_size=batch_size, num_workers=0, train=train, seed=0)
    batches = list(itertools.islice(loader, len(loader.batch_sampler)))  # training: the first epoch of the stream
    assert len(batches) == expected_batches  # train drops the last partial batch of 10 images
    seen = []
    for images, masks, targets in batches:
        assert images.shape[0] == masks.shape[0] == len(targets) <= batch_size
        assert images.dtype == torch.uint8  # pixels: the model normalizes them
        for image_mask, target in zip(masks, targets):
            h, w = target["size"].tolist()
            assert not image_mask[:h, :w].any() and image_mask.sum() == image_mask.numel() - h * w
        seen += [int(t["image_id"]) for t in targets]
    if not train:
        assert seen == dataset.ids[: len(seen)], "validation keeps file order"


def test_worker_loading_is_reproducible_from_the_seed(synthetic_root):
    dataset = build_dataset("train", {"name": "coco", "root": str(synthetic_root), **SMALL_TRANSFORMS})

    def first_epoch(seed: int) -> list:
        loader = build_data_loader(dataset, batch_size=2, num_workers=1, train=True, seed=seed)
        return [
            (images, [t["boxes"] for t in targets])
            for images, _, targets in itertools.islice(loader, loader.batch_sampler.steps_per_epoch)
        ]

    a, b, c = first_epoch(0), first_epoch(0), first_epoch(1)
    assert len(a) == len(b) == SMALL["num_train"] // 2
    for (images_a, boxes_a), (images_b, boxes_b) in zip(a, b):
        assert torch.equal(images_a, images_b) and all(torch.equal(x, y) for x, y in zip(boxes_a, boxes_b))
    assert any(x[0].shape != y[0].shape or not torch.equal(x[0], y[0]) for x, y in zip(a, c))


def test_a_large_split_written_by_several_processes_is_the_set_one_process_writes(tmp_path, monkeypatch):
    import datasets.synthetic as synthetic

    def written(root):
        return [(f.name, f.read_bytes()) for f in sorted((root / "val2017").iterdir())] + [
            (root / "annotations" / "instances_val2017.json").read_text()
        ]

    monkeypatch.setattr(synthetic, "IMAGES_PER_WRITER", 8)
    monkeypatch.setattr(synthetic, "MAX_WRITERS", 3)
    several = synthetic.ensure_synthetic_dataset(tmp_path / "several", num_train=1, num_val=40, image_size=32, seed=5)
    monkeypatch.setattr(synthetic, "MAX_WRITERS", 1)
    one = synthetic.ensure_synthetic_dataset(tmp_path / "one", num_train=1, num_val=40, image_size=32, seed=5)
    assert written(several) == written(one)
