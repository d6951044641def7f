"""The trainer end to end on one's own classes (CPU, tiny): fine-tune with model.init_from onto a synthetic set
with fewer categories, per-class AP in the evaluation json and TensorBoard, detection images, eval_only."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import ROOT, tiny_model_overrides
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train as trainer
from engine.checkpoint.io import load_checkpoint
from engine.errors import CheckpointError

STEPS = 2  # 12 training images, batch 4, one epoch (a batch's worth left over in the size buckets)

pytestmark = pytest.mark.slow


def compose_run(data_root: Path, output_dir: Path, *extra: str):
    overrides = [
        f"dataset.root={data_root}",
        "dataset.num_train=12",
        "dataset.num_val=6",
        "dataset.image_size=64",
        "dataset.train_scales=[64]",
        "dataset.max_size=80",
        "dataset.val_size=64",
        *tiny_model_overrides(),
        "epochs=1",
        "batch_size=4",
        "num_workers=0",
        "log_every=1",
        "optim.lr=1e-3",
        "device=cpu",
        "eval_images=2",
        "eval_images_min_score=0.0",
        f"output_dir={output_dir}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def events(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 6-class box-refinement run, then a 3-class fine-tune of it through a config that says base variant."""
    tmp = tmp_path_factory.mktemp("own_data")
    source = trainer.train(compose_run(tmp / "six", tmp / "source", "experiment=box_refine"))
    return {"tmp": tmp, "source": source["output_dir"]}


@pytest.fixture(scope="module")
def finetune(runs):
    tmp = runs["tmp"]
    handler, logger = _ListHandler(), logging.getLogger("engine.checkpoint.init_from")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        result = trainer.train(
            compose_run(
                tmp / "three",
                tmp / "finetune",
                "dataset.num_categories=3",
                "model.num_classes=4",
                f"model.init_from={runs['source'] / 'checkpoint.pth'}",
            )
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {**result, "log": handler.lines}


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_finetune_starts_a_new_run_from_the_checkpoint(runs, finetune):
    assert finetune["step"] == STEPS and len(finetune["losses"]) == STEPS, "epoch 0, step 0: not a resume"
    ckpt = load_checkpoint(finetune["output_dir"] / "checkpoint.pth")
    assert (ckpt["epoch"], ckpt["step"]) == (1, STEPS)
    assert ckpt["model"]["class_embed.0.bias"].shape == (4,)
    # The variant came from the checkpoint and is what the new checkpoint records.
    assert ckpt["config"]["model"]["with_box_refine"] is True
    assert ckpt["config"]["model"]["init_from"] == str(runs["source"] / "checkpoint.pth")
    # A fresh optimizer: its step count is this run's, not the source's plus this run's.
    assert {int(s["step"]) for s in ckpt["optimizer"]["state"].values()} == {STEPS}
    (line,) = [m for m in finetune["log"] if m.startswith("init_from")]
    assert "num_classes 7 -> 4" in line and "skipped 0 checkpoint tensors" in line


def test_evaluation_json_and_tensorboard_have_per_class_ap_and_images(finetune):
    run_dir = finetune["output_dir"]
    evaluation = json.loads((run_dir / "eval_epoch0001.json").read_text())
    assert list(evaluation["per_class"]) == ["person", "bicycle", "car"]
    assert all(v is None or 0.0 <= v <= 1.0 for v in evaluation["per_class"].values())
    acc = events(run_dir)
    assert {f"eval_per_class/{name}" for name, v in evaluation["per_class"].items() if v is not None} <= set(
        acc.Tags()["scalars"]
    )
    image_tags = [t for t in acc.Tags()["images"] if t.startswith("eval_images/")]
    assert len(image_tags) == 2
    assert all([e.step for e in acc.Images(tag)] == [STEPS] for tag in image_tags)


def test_eval_only_reports_per_class_and_images(finetune, runs, tmp_path):
    cfg = compose_run(
        runs["tmp"] / "three",
        tmp_path,
        "dataset.num_categories=3",
        "eval_only=true",
        f"checkpoint={finetune['output_dir'] / 'checkpoint.pth'}",
    )
    trainer.evaluate_checkpoint(cfg)
    written = json.loads((tmp_path / "eval.json").read_text())
    trained = json.loads((finetune["output_dir"] / "eval_epoch0001.json").read_text())
    assert written["per_class"] == pytest.approx(trained["per_class"], abs=1e-12)
    assert len([t for t in events(tmp_path).Tags()["images"] if t.startswith("eval_images/")]) == 2


def test_init_from_of_another_size_stops_before_training(runs, tmp_path):
    cfg = compose_run(
        runs["tmp"] / "six", tmp_path, "model.hidden_dim=64", f"model.init_from={runs['source'] / 'checkpoint.pth'}"
    )
    with pytest.raises(
        CheckpointError,
        match=r"model\.init_from=.*checkpoint\.pth: \d+ parameters have other shapes.*"
        r"hidden_dim=32 \(config: 64\)",
    ):
        trainer.train(cfg)
    assert not (tmp_path / "checkpoint.pth").exists()
    assert torch.is_tensor(load_checkpoint(runs["source"] / "checkpoint.pth")["model"]["query_embed.weight"])
