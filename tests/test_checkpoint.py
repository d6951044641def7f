"""Checkpoints: atomic writes, clear errors for unreadable files, official-format reading, resume lookup."""

import argparse
import logging
import os
import random
import re
import time

import numpy as np
import pytest
import torch

from engine.checkpoint.contents import check_training_state, load_model_weights, model_config_for_checkpoint
from engine.checkpoint.io import load_checkpoint, publish_as, save_checkpoint
from engine.errors import CheckpointError, CheckpointWriteError
from engine.runtime.rng import capture_rng_state, restore_rng_state
from engine.train.resume import find_resume_checkpoint


@pytest.fixture
def state():
    return {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7, "config": {"model": {"hidden_dim": 8}}}


def test_save_and_load_round_trip(tmp_path, state):
    path = save_checkpoint(state, tmp_path / "sub" / "checkpoint.pth")
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 7
    assert sorted(os.listdir(path.parent)) == ["checkpoint.pth"]  # no temporary file left behind


def test_interrupted_save_keeps_the_previous_file(tmp_path, state, monkeypatch):
    path = save_checkpoint(state, tmp_path / "checkpoint.pth")
    before = path.read_bytes()

    def dies_half_way(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({**state, "step": 8}, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pth"]


@pytest.mark.parametrize("content", [b"", b"definitely not a checkpoint", b"PK\x03\x04truncated zip"])
def test_unreadable_checkpoint_names_the_file(tmp_path, content):
    path = tmp_path / "broken.pth"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"could not read checkpoint .*broken\.pth.*expected|not a torch.save"):
        load_checkpoint(path)


def test_truncated_checkpoint_is_a_clear_error(tmp_path, state):
    path = save_checkpoint(state, tmp_path / "checkpoint.pth")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=re.escape("checkpoint.pth")):
        load_checkpoint(path)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pth")


def test_checkpoint_without_model_is_rejected(tmp_path):
    torch.save({"weights": {}}, tmp_path / "other.pth")
    with pytest.raises(CheckpointError, match=re.escape("expected a torch.save file holding a dict with a 'model'")):
        load_checkpoint(tmp_path / "other.pth")


def test_official_checkpoint_records_the_variant(tmp_path):
    args = argparse.Namespace(
        with_box_refine=True,
        two_stage=True,
        num_queries=300,
        hidden_dim=256,
        lr=2e-4,
        output_dir="exps/r50",
        dataset_file="coco",
    )
    torch.save({"model": {"w": torch.zeros(1)}, "args": args, "epoch": 49}, tmp_path / "official.pth")
    ckpt = load_checkpoint(tmp_path / "official.pth")
    cfg_model = {
        "with_box_refine": False,
        "two_stage": False,
        "num_queries": 300,
        "hidden_dim": 256,
        "num_classes": 91,
        "msda": "triton",
        "pretrained": "imagenet",
    }
    merged = model_config_for_checkpoint(cfg_model, ckpt, path="official.pth")
    assert merged["with_box_refine"] and merged["two_stage"]
    assert merged["num_classes"] == 91 and merged["msda"] == "triton" and merged["pretrained"] == "none"
    assert "lr" not in merged  # only keys the model config has


def test_our_checkpoint_records_its_config():
    ckpt = {"model": {}, "config": {"model": {"hidden_dim": 64, "msda": "pytorch", "num_classes": 7}}}
    merged = model_config_for_checkpoint({"hidden_dim": 256, "msda": "triton", "num_classes": 91}, ckpt, path="x")
    assert merged == {"hidden_dim": 64, "msda": "triton", "num_classes": 7}


def test_a_recorded_value_is_logged_as_written_not_as_an_enum(caplog):
    from models.model_config import BackboneName

    ckpt = {"model": {}, "config": {"model": {"backbone": "resnet18"}}}
    with caplog.at_level(logging.INFO, logger="engine.checkpoint"):
        merged = model_config_for_checkpoint({"backbone": BackboneName.resnet50}, ckpt, path="run.pth")
    assert merged == {"backbone": "resnet18"}
    assert "model.backbone='resnet18' as recorded in run.pth (config said 'resnet50')" in caplog.text


def test_weights_that_do_not_fit_name_the_variant():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"does not fit the model.*missing.*with_box_refine"):
        load_model_weights(model, {"model": {"1.weight": torch.zeros(2, 2)}}, path="x.pth")
    ddp_state = {f"module.{k}": v for k, v in model.state_dict().items()}
    load_model_weights(model, {"model": ddp_state}, path="x.pth")  # a DDP prefix is accepted


def test_epoch_copy_survives_replacing_the_latest(tmp_path, state):
    epoch_file = save_checkpoint(state, tmp_path / "checkpoint_epoch0001.pth")
    publish_as(epoch_file, tmp_path / "checkpoint.pth")
    assert load_checkpoint(tmp_path / "checkpoint.pth")["step"] == 7
    save_checkpoint({**state, "step": 9}, tmp_path / "checkpoint.pth")
    assert load_checkpoint(epoch_file)["step"] == 7
    assert load_checkpoint(tmp_path / "checkpoint.pth")["step"] == 9


def test_a_failed_publish_names_both_files_and_keeps_the_epoch_file(tmp_path, state, monkeypatch):
    import engine.checkpoint.io

    epoch_file = save_checkpoint(state, tmp_path / "checkpoint_epoch0001.pth")

    def no_room(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine.checkpoint.io.os, "link", no_room)  # a filesystem without links, then a full disk
    monkeypatch.setattr(engine.checkpoint.io.shutil, "copyfile", no_room)
    with pytest.raises(
        CheckpointWriteError,
        match=r"wrote checkpoint .*checkpoint_epoch0001\.pth but could not "
        r"publish it as .*checkpoint\.pth \(No space left on device\); "
        r".*resume=",
    ):
        publish_as(epoch_file, tmp_path / "checkpoint.pth")
    monkeypatch.undo()
    assert load_checkpoint(epoch_file)["step"] == 7 and not (tmp_path / "checkpoint.pth").exists()


def test_resume_lookup(tmp_path, state):
    outputs, run = tmp_path / "outputs", tmp_path / "outputs" / "2026-01-02" / "10-00-00"

    def find(resume):  # this run has the same config as the checkpoints (others: test_reliability_resume.py)
        return find_resume_checkpoint(resume, output_dir=run, search_root=outputs, config=state["config"])

    assert find(None) is None
    assert find("auto") is None
    older = save_checkpoint(state, outputs / "2026-01-01" / "09-00-00" / "checkpoint.pth")
    newer = save_checkpoint(state, outputs / "2026-01-01" / "08-00-00" / "checkpoint.pth")
    os.utime(older, (time.time() - 100, time.time() - 100))
    assert find("auto") == newer
    own = save_checkpoint(state, run / "checkpoint.pth")
    os.utime(own, (time.time() - 1000, time.time() - 1000))
    assert find("auto") == own  # this run's own first
    assert find(str(older.parent)) == older
    with pytest.raises(CheckpointError, match="no checkpoint file"):
        find(str(tmp_path / "missing.pth"))


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    save_checkpoint({"model": {}, "rng": capture_rng_state()}, tmp_path / "c.pth")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng_state(load_checkpoint(tmp_path / "c.pth")["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_official_checkpoint_cannot_be_resumed():
    with pytest.raises(CheckpointError, match=r"official\.pth cannot be resumed: it has no optimizer.*eval_only"):
        check_training_state({"model": {}, "args": argparse.Namespace(), "epoch": 49}, path="official.pth")


def test_a_run_directory_names_its_checkpoint_and_a_missing_one_says_which(tmp_path, state):
    run = tmp_path / "run"
    save_checkpoint(state, run / "checkpoint.pth")
    assert load_checkpoint(run)["step"] == 7  # checkpoint=<run directory>, as resume= takes it
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(CheckpointError, match=r"checkpoint .*empty_run is a directory without a checkpoint\.pth"):
        load_checkpoint(tmp_path / "empty_run")
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint .*nowhere/c\.pth does not exist, nor does its folder "
        r".*nowhere \(expected",
    ):
        load_checkpoint(tmp_path / "nowhere" / "c.pth")
    with pytest.raises(CheckpointError, match=r"checkpoint .*run/other\.pth does not exist \(expected"):
        load_checkpoint(run / "other.pth")
