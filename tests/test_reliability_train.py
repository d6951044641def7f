"""The trainer with faults a user makes (CPU, tiny runs of 2 steps per epoch): overrides on resume,
resume=auto among other runs' checkpoints, one's own data with num_classes from the annotations, and
damaged images found before training or, during it, named with the checkpoint to go on from."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ROOT, tiny_model_overrides
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train as trainer
from datasets import ImageReadError, build_dataset
from engine.checkpoint.io import load_checkpoint
from engine.errors import CheckpointError

STEPS_PER_EPOCH = 2  # 12 training images, batch 4 (a batch's worth left over in the size buckets)

pytestmark = pytest.mark.slow

RUN = [
    *tiny_model_overrides(),
    "epochs=1",
    "batch_size=4",
    "num_workers=0",
    "log_every=1",
    "eval_every=1",
    "checkpoint_every=1",
    "optim.lr=1e-3",
    "device=cpu",
]
SIZES = ["dataset.train_scales=[64]", "dataset.max_size=80", "dataset.val_size=64"]


def synthetic(data_root: Path) -> list[str]:
    return [f"dataset.root={data_root}", "dataset.num_train=12", "dataset.num_val=4", "dataset.image_size=64", *SIZES]


def compose_run(output_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=[*RUN, f"output_dir={output_dir}", *overrides])


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, data_root) -> Path:
    """One epoch; its checkpoint.pth is the one the tests resume from."""
    return trainer.train(compose_run(tmp_path_factory.mktemp("first"), *synthetic(data_root)))["output_dir"]


def warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_resume_applies_a_new_lr_and_keeps_the_model(first_run, data_root, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        result = trainer.train(
            compose_run(
                tmp_path,
                *synthetic(data_root),
                f"resume={first_run / 'checkpoint.pth'}",
                "epochs=2",
                "optim.lr=5e-4",
                "model.hidden_dim=64",
            )
        )
    assert result["step"] == 2 * STEPS_PER_EPOCH
    text = warnings(caplog)
    assert "optim.lr: 0.0005 from the command line, applied (the checkpoint had 0.001)" in text
    assert "model.hidden_dim: 32 kept from the checkpoint, not 64" in text
    lrs = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0}).Reload().Scalars("train/lr")
    assert [(e.step, e.value) for e in lrs] == [(3, pytest.approx(5e-4)), (4, pytest.approx(5e-4))]
    ckpt = load_checkpoint(tmp_path / "checkpoint.pth")
    assert ckpt["config"]["model"]["hidden_dim"] == 32 and ckpt["config"]["optim"]["lr"] == 5e-4
    assert {g["name"]: g["lr"] for g in ckpt["optimizer"]["param_groups"]}["rest"] == pytest.approx(5e-4)


def test_resume_auto_continues_only_a_run_of_the_same_model(first_run, data_root, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # resume=auto searches ./outputs
    earlier = tmp_path / "outputs" / "2026-01-01" / "10-00-00" / "checkpoint.pth"
    earlier.parent.mkdir(parents=True)
    shutil.copy(first_run / "checkpoint.pth", earlier)

    with caplog.at_level(logging.WARNING):  # a new experiment: other queries; it must not resume (or crash on) that
        other = trainer.train(
            compose_run(tmp_path / "other", *synthetic(data_root), "resume=auto", "model.num_queries=12")
        )
    assert other["step"] == STEPS_PER_EPOCH  # started from scratch
    assert "resume=auto: starting from scratch; the 1 checkpoints under outputs are of other runs" in warnings(caplog)
    assert "model.num_queries differ" in warnings(caplog)

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        same = trainer.train(compose_run(tmp_path / "same", *synthetic(data_root), "resume=auto", "epochs=2"))
    assert same["step"] == 2 * STEPS_PER_EPOCH  # continued after the first run's epoch
    assert f"resume=auto: continuing {Path('outputs/2026-01-01/10-00-00/checkpoint.pth')}" in warnings(caplog)


def test_nothing_left_to_train_stops_before_training(first_run, data_root, tmp_path):
    with pytest.raises(ValueError, match=r"has completed 1 epochs and epochs=1: nothing is left to train"):
        trainer.train(compose_run(tmp_path, *synthetic(data_root), f"resume={first_run}"))
    assert not (tmp_path / "tensorboard").exists()


def copy_of(data_root: Path, destination: Path) -> Path:
    build_dataset(
        "val", {"name": "synthetic", "root": str(data_root), "num_train": 12, "num_val": 4, "image_size": 64}
    )  # make sure the set exists
    shutil.copytree(data_root, destination)
    return destination


def test_own_data_takes_num_classes_from_the_annotations_and_names_a_damaged_image(data_root, tmp_path, caplog):
    data = copy_of(data_root, tmp_path / "mydata")
    own = [
        f"dataset.train_images={data / 'train2017'}",
        f"dataset.val_images={data / 'val2017'}",
        f"dataset.train_annotations={data / 'annotations' / 'instances_train2017.json'}",
        f"dataset.val_annotations={data / 'annotations' / 'instances_val2017.json'}",
        *SIZES,
        "dataset.verify=false",
    ]
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        trainer.train(compose_run(run_dir, "dataset=custom", "model=tiny", *own))  # num_classes: null there
    assert "model.num_classes=null: using 7, the largest category id in" in caplog.text
    assert load_checkpoint(run_dir / "checkpoint.pth")["config"]["model"]["num_classes"] == 7

    damaged = data / "train2017" / "000000000003.jpg"
    damaged.write_bytes(damaged.read_bytes()[:200])  # found only when loaded: dataset.verify=false
    with pytest.raises(
        ImageReadError,
        match=r"(?s)cannot read image .*000000000003\.jpg.*The run's last checkpoint "
        r"is .*run/checkpoint\.pth: fix or remove the file .*resume=",
    ):
        trainer.train(compose_run(run_dir, "dataset=custom", "model=tiny", *own, "resume=auto", "epochs=2"))
    assert load_checkpoint(run_dir / "checkpoint.pth")["epoch"] == 1  # the trained epoch is still there


def test_a_damaged_validation_image_stops_the_run_before_training(data_root, tmp_path):
    data = copy_of(data_root, tmp_path / "synthetic")
    (data / "val2017" / "000000000002.jpg").write_bytes(b"")
    run_dir = tmp_path / "run"
    with pytest.raises(
        ImageReadError,
        match=r"1 of the 4 images of .*instances_val2017\.json cannot be used: "
        r".*val2017/000000000002\.jpg",
    ):
        trainer.train(compose_run(run_dir, *synthetic(data)))
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "checkpoint.pth").exists()


def test_weights_of_another_size_name_the_checkpoint_not_a_wall_of_mismatches(first_run, data_root, tmp_path):
    weights_only = tmp_path / "weights_only.pth"  # no config: the command line's model is built, 12 queries
    torch.save({"model": load_checkpoint(first_run / "checkpoint.pth")["model"]}, weights_only)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint .*weights_only\.pth does not fit the model: \d+ parameters "
        r"differ in shape \(e\.g\. .*\(10, 64\) in the checkpoint, \(12, 64\) in "
        r"the model",
    ) as error:
        trainer.evaluate_checkpoint(
            compose_run(
                tmp_path / "eval",
                *synthetic(data_root),
                "eval_only=true",
                f"checkpoint={weights_only}",
                "model.num_queries=12",
            )
        )
    assert len(str(error.value).splitlines()) == 1
