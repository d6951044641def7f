"""Checkpoint files that are not what they should be: foreign files, other sizes, leftovers of killed saves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import dead_pid

from engine.checkpoint.contents import load_model_weights, read_recorded_config
from engine.checkpoint.io import load_checkpoint, remove_stray_temporaries, save_checkpoint
from engine.errors import CheckpointError


@pytest.mark.parametrize(
    "content", ["hello, this is a text file\n", '{"model": {"w": [1, 2]}}', "model:\n  w: 1\n", "epoch,loss\n1,0.5\n"]
)
def test_a_text_file_is_a_checkpoint_error_naming_it(tmp_path, content):
    path = tmp_path / "notes.pth"
    path.write_text(content)
    with pytest.raises(
        CheckpointError,
        match=r"could not read checkpoint .*notes\.pth \(.*\); the file is truncated, "
        r"corrupt or not a torch\.save file",
    ):
        load_checkpoint(path)


def test_weights_of_another_size_name_the_file_and_the_parameter(tmp_path):
    small, large = torch.nn.Linear(4, 7), torch.nn.Linear(4, 91)
    path = tmp_path / "weights_only.pth"
    torch.save({"model": large.state_dict()}, path)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint .*weights_only\.pth does not fit the model: 2 parameters "
        r"differ in shape \(e\.g\. weight \(91, 4\) in the checkpoint, \(7, 4\) "
        r"in the model.*model\.num_classes",
    ):
        load_model_weights(small, load_checkpoint(path), path=path)


def test_the_next_save_removes_what_killed_saves_left(tmp_path):
    pid = dead_pid()
    stray = [tmp_path / f".checkpoint.pth.{pid}.tmp", tmp_path / f".checkpoint_epoch0003.pth.{pid}.tmp"]
    for path in stray:
        path.write_bytes(b"PK\x03\x04 half a checkpoint")
    in_progress = tmp_path / f".checkpoint.pth.{os.getppid()}.tmp"  # a live process (pytest's parent) saving
    in_progress.write_bytes(b"still being written")
    not_ours = tmp_path / ".notes.tmp"
    not_ours.write_text("someone else's")

    save_checkpoint({"model": {}, "step": 1}, tmp_path / "checkpoint.pth")
    assert not any(path.exists() for path in stray)
    assert in_progress.exists() and not_ours.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["checkpoint.pth", in_progress.name, not_ours.name])


def test_a_save_killed_with_sigkill_leaves_a_temporary_that_the_next_save_removes(tmp_path):
    """A real kill -9 in the middle of torch.save (the child blocks inside it until killed)."""
    script = (
        "import sys, threading, torch\n"
        f"sys.path.insert(0, {str(os.getcwd())!r})\n"
        "from engine.checkpoint.io import save_checkpoint\n"
        "real_save = torch.save\n"
        "def stalls(obj, f, *a, **k):\n"
        "    f.write(b'PK partial'); f.flush(); print('writing', flush=True); threading.Event().wait()\n"
        "torch.save = stalls\n"
        f"save_checkpoint({{'model': {{}}}}, {str(tmp_path / 'checkpoint.pth')!r})\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.kill()
        child.wait()
    leftovers = list(tmp_path.glob(".checkpoint.pth.*.tmp"))
    assert len(leftovers) == 1 and not (tmp_path / "checkpoint.pth").exists()
    assert remove_stray_temporaries(tmp_path) == leftovers
    assert list(tmp_path.iterdir()) == []


def test_recorded_config_is_read_without_loading_everything(tmp_path):
    path = save_checkpoint(
        {"model": {"w": torch.zeros(1000)}, "config": {"model": {"hidden_dim": 32}}}, tmp_path / "checkpoint.pth"
    )
    assert read_recorded_config(path) == {"model": {"hidden_dim": 32}}
    (tmp_path / "junk.pth").write_text("not a checkpoint")
    assert read_recorded_config(tmp_path / "junk.pth") is None
    torch.save({"model": {}}, tmp_path / "official.pth")
    assert read_recorded_config(tmp_path / "official.pth") is None
