"""predict.py: detections of a checkpoint on a folder of images, as COCO results, drawn, and evaluated (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import CATEGORIES, ROOT, child_env, write_checkpoint
from hydra import compose, initialize_config_dir
from PIL import Image
from pycocotools.coco import COCO

import predict as predictor
from datasets import ImageReadError
from datasets.image_folder import ImageFolder
from engine.checkpoint.trained_model import load_trained_model

EXIF_ORIENTATION, TURNED_RIGHT = 0x0112, 6  # stored pixels shown turned 90 degrees clockwise


def compose_predict(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="predict", overrides=["device=cpu", "num_workers=0", *overrides])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "checkpoint.pth")


def _photo(seed: int, size=(120, 90)) -> Image.Image:
    """A picture with a few coloured rectangles on noise (width, height = ``size``)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 60, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    for _ in range(3):
        x, y = (int(v) for v in torch.randint(0, min(size) // 2, (2,), generator=g))
        pixels[y : y + 30, x : x + 40] = torch.randint(100, 255, (3,), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Four images: JPEG and PNG, wide and tall, one in a subfolder, one in palette mode."""
    root = tmp_path_factory.mktemp("photos")
    _photo(0).save(root / "a.jpg", quality=95)
    _photo(1, (80, 112)).save(root / "b.png")
    (root / "sub").mkdir()
    _photo(2).save(root / "sub" / "c.jpg", quality=95)
    _photo(3, (100, 100)).convert("P").save(root / "sub" / "d.png")
    (root / "notes.txt").write_text("not an image")
    return root


def test_detections_are_coco_results_of_the_images_that_pycocotools_loads(checkpoint, folder, tmp_path):
    out = predictor.predict(
        compose_predict(
            f"checkpoint={checkpoint}",
            f"images={folder}",
            f"output_dir={tmp_path}",
            "score_threshold=0.1",
            "max_detections=5",
        )
    )
    images = COCO(str(tmp_path / "images.json"))
    assert sorted(i["file_name"] for i in images.imgs.values()) == ["a.jpg", "b.png", "sub/c.jpg", "sub/d.png"]
    assert {c["id"]: c["name"] for c in images.cats.values()} == CATEGORIES
    detections = json.loads((tmp_path / "detections.json").read_text())
    assert detections == out["detections"] and len(detections) > 0
    results = images.loadRes(str(tmp_path / "detections.json"))  # pycocotools' own checks of the format
    assert len(results.anns) == len(detections)
    for image_id, image in images.imgs.items():
        own = [d for d in detections if d["image_id"] == image_id]
        assert len(own) <= 5
        for d in own:
            x, y, w, h = d["bbox"]
            assert d["score"] >= 0.1 and d["category_id"] in range(4)
            assert x >= -0.01 and x + w <= image["width"] + 0.01 and y >= -0.01 and y + h <= image["height"] + 0.01


def test_boxes_are_in_the_pixels_of_the_image_as_shown(checkpoint, tmp_path):
    """A photo stored turned, with an EXIF orientation that turns it back, gives the detections of the photo
    stored upright: in its shown pixels, not its stored ones."""
    upright, turned = tmp_path / "upright", tmp_path / "turned"
    upright.mkdir(), turned.mkdir()
    photo = _photo(5, (128, 96))
    photo.save(upright / "p.jpg", quality=100, subsampling=0)
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = TURNED_RIGHT
    # Orientation 6 shows the stored pixels turned 90 degrees clockwise: store them turned the other way.
    photo.transpose(Image.Transpose.ROTATE_90).save(turned / "p.jpg", quality=100, subsampling=0, exif=exif)
    results = [
        predictor.predict(
            compose_predict(
                f"checkpoint={checkpoint}",
                f"images={d}",
                f"output_dir={tmp_path / ('out_' + d.name)}",
                "score_threshold=0.2",
                "draw=false",
            )
        )
        for d in (upright, turned)
    ]
    a, b = ([d["bbox"] for d in r["detections"]] for r in results)
    assert len(a) == len(b) > 0
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1.5, rtol=0)  # JPEG's loss, not a turn
    shown = COCO(str(tmp_path / "out_turned" / "images.json")).imgs[1]
    assert (shown["width"], shown["height"]) == (128, 96)


def test_boxes_are_the_models_relative_boxes_scaled_to_the_original_image(checkpoint, folder, tmp_path):
    out = predictor.predict(
        compose_predict(
            f"checkpoint={checkpoint}",
            f"images={folder / 'a.jpg'}",
            f"output_dir={tmp_path}",
            "score_threshold=0",
            "max_detections=3",
            "draw=false",
        )
    )
    trained = load_trained_model(
        str(checkpoint), compose_predict("checkpoint=x", "images=y").model, device=torch.device("cpu")
    )
    image, info = ImageFolder([folder / "a.jpg"], val_size=trained.val_size, max_size=trained.max_size)[0]
    with torch.no_grad():
        outputs = trained.model(image[None], torch.zeros(1, *image.shape[-2:], dtype=torch.bool))
    probabilities = outputs["pred_logits"][0].sigmoid().flatten()
    top = probabilities.topk(3).indices
    queries, labels = top // outputs["pred_logits"].shape[-1], top % outputs["pred_logits"].shape[-1]
    cx, cy, w, h = outputs["pred_boxes"][0, queries].unbind(-1)
    height, width = info["orig_size"]
    x0, x1 = ((cx - w / 2) * width).clamp(0, width), ((cx + w / 2) * width).clamp(0, width)
    y0, y1 = ((cy - h / 2) * height).clamp(0, height), ((cy + h / 2) * height).clamp(0, height)
    expected = torch.stack([x0, y0, x1 - x0, y1 - y0], -1)  # cut at the image's edges
    got = torch.tensor([d["bbox"] for d in out["detections"]])
    torch.testing.assert_close(got, expected, atol=0.02, rtol=0)
    assert [d["category_id"] for d in out["detections"]] == labels.tolist()


def test_pictures_show_the_detections(checkpoint, folder, tmp_path):
    predictor.predict(
        compose_predict(f"checkpoint={checkpoint}", f"images={folder}", f"output_dir={tmp_path}", "score_threshold=0.1")
    )
    drawn = sorted(p.relative_to(tmp_path / "images").as_posix() for p in (tmp_path / "images").rglob("*.*"))
    assert drawn == ["a.jpg", "b.png", "sub/c.jpg", "sub/d.png"]  # each file's own name and format
    assert Image.open(tmp_path / "images" / "b.png").format == "PNG"
    picture = Image.open(tmp_path / "images" / "a.jpg")
    assert picture.size == (480, 360)  # 120x90 enlarged by the whole factor that brings it past 384 pixels: 4
    original = torch.from_numpy(np.asarray(_photo(0).resize(picture.size), dtype=np.float32))
    shown = torch.from_numpy(np.asarray(picture, dtype=np.float32))
    assert (shown - original).abs().max() > 100  # boxes and labels drawn over the photo


def test_an_official_checkpoints_classes_are_cocos(tmp_path):
    """A class head of COCO's 91 rows without recorded names (an official checkpoint) is named as COCO."""
    from engine.checkpoint.trained_model import recorded_categories

    names = recorded_categories({"model": {}}, 91)
    assert names[1] == "person" and names[90] == "toothbrush" and 12 not in names
    assert recorded_categories({"categories": {3: "car"}}, 91) == {3: "car"}
    assert recorded_categories({}, 5) == {}


def test_annotations_evaluate_the_detections_and_name_the_classes(checkpoint, folder, tmp_path):
    images = [
        {"id": 10 + i, "file_name": name, "width": w, "height": h}
        for i, (name, (w, h)) in enumerate([("a.jpg", (120, 90)), ("sub/c.jpg", (120, 90))])
    ]
    annotations = [
        {"id": 1, "image_id": 10, "category_id": 2, "bbox": [10, 10, 40, 30], "area": 1200, "iscrowd": 0},
        {"id": 2, "image_id": 11, "category_id": 1, "bbox": [5, 20, 40, 30], "area": 1200, "iscrowd": 0},
    ]
    gt = tmp_path / "gt.json"
    gt.write_text(
        json.dumps(
            {
                "images": images,
                "annotations": annotations,
                "categories": [{"id": 1, "name": "ring"}, {"id": 2, "name": "box"}, {"id": 3, "name": "wedge"}],
            }
        )
    )
    out = predictor.predict(
        compose_predict(
            f"checkpoint={checkpoint}",
            f"images={folder}",
            f"output_dir={tmp_path / 'o'}",
            f"annotations={gt}",
            "score_threshold=0.5",
        )
    )
    record = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert record["num_images"] == 2 and set(out["eval"]) == {"AP", "AP50", "AP75", "APs", "APm", "APl"}
    assert record["AP"] == out["eval"]["AP"] and set(record["per_class"]) == {"ring", "box", "wedge"}
    written = COCO(str(tmp_path / "o" / "images.json"))
    ids = {i["file_name"]: i["id"] for i in written.imgs.values()}
    assert ids["a.jpg"] == 10 and ids["sub/c.jpg"] == 11 and ids["b.png"] > 11 and ids["sub/d.png"] > 11
    assert {c["name"] for c in written.cats.values()} == {"ring", "box", "wedge"}


def test_an_unreadable_image_is_skipped_with_one_warning_and_the_good_ones_written(
    checkpoint, folder, tmp_path, caplog
):
    """The unreadable image in the first batch: the good images' detections and pictures are written all the
    same; an image and another of the same name but another format are two pictures."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "good.jpg").write_bytes((folder / "a.jpg").read_bytes())
    (broken / "good.png").write_bytes((folder / "b.png").read_bytes())
    (broken / "bad.jpg").write_bytes((folder / "a.jpg").read_bytes()[:300])  # truncated
    with caplog.at_level("WARNING", logger="engine"):
        out = predictor.predict(
            compose_predict(
                f"checkpoint={checkpoint}",
                f"images={broken}",
                "batch_size=4",
                f"output_dir={tmp_path / 'o'}",
                "score_threshold=0",
            )
        )
    assert out["skipped"] == [str(broken / "bad.jpg")]
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("bad.jpg" in w for w in warnings) == 1 and any("1 of 3 images could not be read" in w for w in warnings)
    written = COCO(str(tmp_path / "o" / "images.json"))
    assert sorted(i["file_name"] for i in written.imgs.values()) == ["good.jpg", "good.png"]
    assert {d["image_id"] for d in out["detections"]} == set(written.imgs)
    assert sorted(p.name for p in (tmp_path / "o" / "images").iterdir()) == ["good.jpg", "good.png"]


def test_a_folder_of_unreadable_images_is_an_error_naming_it(checkpoint, folder, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "bad.jpg").write_bytes((folder / "a.jpg").read_bytes()[:300])
    with pytest.raises(ImageReadError, match=r"none of the 1 images of images=.*broken could be read"):
        predictor.predict(
            compose_predict(f"checkpoint={checkpoint}", f"images={broken}", f"output_dir={tmp_path / 'o'}")
        )


@pytest.mark.parametrize(
    "setting,message",
    [
        ("empty", r"images=.*holds no image files"),
        ("missing", r"images=.*no such file or folder"),
        ("score_threshold=1.5", r"score_threshold must be a number in \[0, 1\], got 1.5"),
        ("max_detections=0", r"max_detections must be an integer >= 1, got 0"),
    ],
)
def test_bad_input_gets_a_clear_error(checkpoint, tmp_path, setting, message):
    (tmp_path / "empty").mkdir()
    images = {"empty": tmp_path / "empty", "missing": tmp_path / "nowhere"}.get(setting, tmp_path / "empty")
    overrides = [f"checkpoint={checkpoint}", f"images={images}", f"output_dir={tmp_path / 'o'}"]
    if "=" in setting:
        overrides.append(setting)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        predictor.predict(compose_predict(*overrides))


def test_the_command_line_prints_one_message_for_a_fault_and_writes_a_log(checkpoint, folder, tmp_path):
    def run(*a):
        return subprocess.run(
            [
                sys.executable,
                str(ROOT / "predict.py"),
                f"checkpoint={checkpoint}",
                "device=cpu",
                "num_workers=0",
                *a,
            ],
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )

    bad = run(f"images={tmp_path / 'nowhere'}", f"output_dir={tmp_path / 'bad'}")
    assert bad.returncode == 1 and "no such file or folder" in bad.stderr + bad.stdout
    assert "Traceback" not in bad.stderr + bad.stdout and not (tmp_path / "bad").exists()
    good = run(f"images={folder}", f"output_dir={tmp_path / 'good'}")
    assert good.returncode == 0, good.stderr
    assert "4/4 images [100%]" in (tmp_path / "good" / "predict.log").read_text()
    assert (tmp_path / "good" / "detections.json").exists()


def test_checkpoint_may_be_a_run_directory(checkpoint, folder, tmp_path):
    out = predictor.predict(
        compose_predict(
            f"checkpoint={checkpoint.parent}", f"images={folder / 'a.jpg'}", f"output_dir={tmp_path}", "draw=false"
        )
    )
    assert out["images"] == 1 and (tmp_path / "detections.json").is_file()


def test_triton_attention_without_a_gpu_is_refused_naming_model_msda(checkpoint, folder, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the interpreter would run the kernels on the CPU
    with pytest.raises(
        ValueError,
        match=r"model\.msda=triton runs the Triton kernels, which need a GPU, but this "
        r"run is on cpu",
    ):
        predictor.predict(
            compose_predict(
                f"checkpoint={checkpoint}", f"images={folder}", "model.msda=triton", f"output_dir={tmp_path / 'o'}"
            )
        )
    assert not (tmp_path / "o" / "detections.json").exists()


def test_the_warning_for_an_unreadable_image_names_the_id_images_json_gives_it(checkpoint, folder, tmp_path):
    """As a user runs it: the second of three images is damaged; the warning names its id as images.json numbers
    the folder (1, 2, 3 in path order), not its position from 0, which is the first image's id there."""
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.jpg").write_bytes((folder / "a.jpg").read_bytes())
    (photos / "b.jpg").write_bytes((folder / "a.jpg").read_bytes()[:300])  # truncated
    (photos / "c.png").write_bytes((folder / "b.png").read_bytes())
    child = subprocess.run(
        [
            sys.executable,
            str(ROOT / "predict.py"),
            f"checkpoint={checkpoint}",
            f"images={photos}",
            "device=cpu",
            "num_workers=0",
            f"output_dir={tmp_path / 'o'}",
        ],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = child.stdout + child.stderr
    assert child.returncode == 0, out
    ids = {i["file_name"]: i["id"] for i in COCO(str(tmp_path / "o" / "images.json")).imgs.values()}
    assert ids == {"a.jpg": 1, "c.png": 3}
    assert out.count(f"skipped cannot read image {photos / 'b.jpg'} (image id 2)") == 1, out


def test_detections_move_with_batch_size_through_padding_as_the_readme_says(checkpoint, folder, tmp_path):
    """Images of other sizes padded into one batch are not what the backbone sees of each alone, as in the original:
    README says so beside predict.py's batch_size."""
    scores = {}
    for batch_size in (1, 4):
        out = predictor.predict(
            compose_predict(
                f"checkpoint={checkpoint}",
                f"images={folder}",
                "draw=false",
                f"batch_size={batch_size}",
                "score_threshold=0",
                f"output_dir={tmp_path / str(batch_size)}",
            )
        )
        scores[batch_size] = sorted(round(d["score"], 4) for d in out["detections"])
    assert scores[1] != scores[4]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (
        "padding changes what the backbone sees: detections and their AP move a little with `batch_size` "
        "(`batch_size=1` pads nothing)"
    ) in readme


def _predict_command(checkpoint: Path, folder: Path, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    # Hydra's flags (-m) go before every override: argparse takes the overrides as one run of positionals.
    flags = [o for o in overrides if o.startswith("-")]
    overrides = tuple(o for o in overrides if not o.startswith("-"))
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "predict.py"),
            *flags,
            f"checkpoint={checkpoint}",
            f"images={folder}",
            "device=cpu",
            "num_workers=0",
            "draw=false",
            *overrides,
        ],
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_multirun_puts_each_job_in_a_folder_of_its_own_under_output_dir(checkpoint, folder, tmp_path):
    runs = tmp_path / "thresholds"
    child = _predict_command(checkpoint, folder, "-m", "score_threshold=0.2,0.5", f"output_dir={runs}", cwd=tmp_path)
    assert child.returncode == 0, child.stdout + child.stderr
    kept = [json.loads((runs / str(job) / "detections.json").read_text()) for job in (0, 1)]
    assert all(d["score"] >= 0.5 for d in kept[1]) and len(kept[0]) >= len(kept[1])
    assert (runs / "0" / "predict.log").is_file() and not (runs / "detections.json").exists()
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


def test_a_training_runs_folder_is_refused_while_it_runs_and_its_record_is_never_replaced(checkpoint, folder, tmp_path):
    """predict.py output_dir=<a training run's folder>: refused while the run lives (its lock), and afterwards its
    detections go beside the run's files, its own Hydra record in .hydra/predict/, the run's .hydra/ left alone."""
    import socket

    from engine.runtime.run_lock import LOCK_FILE

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("the training run's config\n")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_dir / LOCK_FILE).write_text(
            json.dumps({"pid": live.pid, "host": socket.gethostname(), "started": "now", "command": "train.py"})
        )
        refused = _predict_command(checkpoint, folder, f"output_dir={run_dir}", cwd=tmp_path)
    finally:
        live.kill()
        live.wait()
    out = refused.stdout + refused.stderr
    assert refused.returncode == 1 and "Traceback" not in out, out
    assert f"run directory {run_dir} is in use by process {live.pid}" in out
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", LOCK_FILE]  # nothing written
    (run_dir / LOCK_FILE).unlink()  # the run has ended

    done = _predict_command(checkpoint, folder, f"output_dir={run_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "the training run's config\n"
    assert (run_dir / ".hydra" / "predict" / "config.yaml").is_file() and (run_dir / "detections.json").is_file()
