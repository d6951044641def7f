"""Checkpoints written in the background (engine/checkpoint/writer.py): the state as it was at the save, the
file whole or not there, one write in flight, and a failed write raised where the run waits."""

from __future__ import annotations

import signal
import threading

import pytest
import torch

import engine.checkpoint.writer
from engine.checkpoint.io import load_checkpoint, save_checkpoint
from engine.checkpoint.writer import CheckpointWriter, host_copy
from engine.errors import CheckpointWriteError


@pytest.fixture
def held_writes(monkeypatch):
    """save_checkpoint that waits for ``release`` before writing: the test sees the write in flight.
    ``writes`` counts the writes that started."""
    release, started, writes = threading.Event(), threading.Event(), []

    def held(state, path):
        writes.append(path)
        started.set()
        assert release.wait(30), "the test never released the write"
        return save_checkpoint(state, path)

    monkeypatch.setattr(engine.checkpoint.writer, "save_checkpoint", held)
    yield started, release, writes
    release.set()  # a test that failed before releasing leaves no writer blocked behind it


def test_the_file_holds_the_state_at_the_save_not_after_the_next_update(tmp_path, held_writes):
    started, release, _ = held_writes
    weight, exp_avg = torch.randn(64), torch.randn(3)
    expected_weight, expected_exp_avg = weight.clone(), exp_avg.clone()
    state = {"model": {"w": weight}, "optimizer": {"state": {0: {"exp_avg": exp_avg}}, "lr": [0.1]}, "step": 7}
    writer = CheckpointWriter()
    writer.save(state, tmp_path / "checkpoint.pth")
    assert started.wait(30) and writer.writing and not (tmp_path / "checkpoint.pth").exists()
    weight.add_(1.0)  # the optimizer's in-place step, while the file is written
    exp_avg.mul_(0.5)
    release.set()
    writer.wait()
    saved = load_checkpoint(tmp_path / "checkpoint.pth")
    assert torch.equal(saved["model"]["w"], expected_weight) and saved["step"] == 7
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], expected_exp_avg)


def test_the_next_save_waits_for_the_one_in_flight(tmp_path, held_writes):
    started, release, writes = held_writes
    writer = CheckpointWriter()
    writer.save({"model": {}, "step": 1}, tmp_path / "checkpoint.pth")
    assert started.wait(30)
    second = threading.Thread(target=writer.save, args=({"model": {}, "step": 2}, tmp_path / "checkpoint.pth"))
    second.start()
    second.join(0.5)
    assert second.is_alive() and len(writes) == 1  # held behind the first write, its own not started
    release.set()
    second.join(30)
    writer.wait()
    assert load_checkpoint(tmp_path / "checkpoint.pth")["step"] == 2


def test_an_epoch_file_is_published_as_latest_once_written(tmp_path):
    writer = CheckpointWriter()
    writer.save(
        {"model": {"w": torch.ones(2)}, "step": 3},
        tmp_path / "checkpoint_epoch0001.pth",
        also_as=tmp_path / "checkpoint.pth",
    )
    writer.wait()
    assert load_checkpoint(tmp_path / "checkpoint.pth")["step"] == 3
    assert load_checkpoint(tmp_path / "checkpoint_epoch0001.pth")["step"] == 3


def test_a_failed_write_is_raised_where_the_run_waits_and_keeps_the_previous_file(tmp_path, monkeypatch):
    import engine.checkpoint.io

    path = tmp_path / "checkpoint.pth"
    writer = CheckpointWriter()
    writer.save({"model": {}, "step": 1}, path)
    writer.wait()

    def full_disk(obj, f):
        f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 24")

    monkeypatch.setattr(engine.checkpoint.io.torch, "save", full_disk)
    with pytest.raises(
        CheckpointWriteError,
        match=r"could not write checkpoint .*checkpoint\.pth .*still holds the "
        r"previous checkpoint",
    ):
        writer.save({"model": {}, "step": 2}, path)
        writer.wait()
    monkeypatch.undo()
    writer.wait()  # raised once: the writer is usable again
    assert load_checkpoint(path)["step"] == 1 and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pth"]


def test_a_failing_run_logs_the_write_error_instead_of_raising_it_over_its_own(tmp_path, monkeypatch, caplog):
    import engine.checkpoint.io

    monkeypatch.setattr(
        engine.checkpoint.io.torch, "save", lambda obj, f: (_ for _ in ()).throw(OSError(28, "No space"))
    )
    writer = CheckpointWriter()
    writer.save({"model": {}}, tmp_path / "checkpoint.pth")
    writer.wait_quietly()
    assert "could not write checkpoint" in caplog.text and not (tmp_path / "checkpoint.pth").exists()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs a POSIX interval timer")
def test_a_failing_runs_wait_interrupted_by_another_error_still_waits_for_the_write(tmp_path, held_writes, caplog):
    """A loader worker's death is raised in the main thread wherever it is (torch's SIGCHLD handler), also into a
    failing run's wait for its checkpoint: the wait goes on until the file is written, and logs nothing of the other
    error. A real signal, as the handler's exception leaves Thread.join (Python 3.11) taking a running thread for
    ended: the process then exits during the write."""
    started, release, _ = held_writes
    writer = CheckpointWriter()
    writer.save({"model": {}, "step": 3}, tmp_path / "checkpoint.pth")
    assert started.wait(30)
    thread, raised = writer._thread, []

    def worker_died(signum, frame):
        raised.append(signum)
        raise RuntimeError("DataLoader worker (pid 1234) is killed by signal: Killed.")

    previous = signal.signal(signal.SIGALRM, worker_died)
    threading.Timer(1.0, release.set).start()  # the write goes on well after the error
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        writer.wait_quietly()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert raised and release.is_set() and not thread.is_alive() and not writer.writing
    assert load_checkpoint(tmp_path / "checkpoint.pth")["step"] == 3
    assert "killed by signal" not in caplog.text


def test_tied_weights_are_copied_once_and_written_once(tmp_path):
    head = torch.nn.Linear(256, 256)  # 256 KB: a second copy in the file would be seen
    model = torch.nn.ModuleDict(
        {"a": head, "b": head, "other": torch.nn.Linear(256, 256)}
    )  # tied, as the model's heads
    copied = host_copy(model.state_dict())
    assert copied["a.weight"] is copied["b.weight"] and copied["a.weight"] is not copied["other.weight"]
    writer = CheckpointWriter()
    writer.save({"model": model.state_dict()}, tmp_path / "tied.pth")
    writer.wait()
    torch.save({"model": model.state_dict()}, tmp_path / "in_line.pth")  # what torch.save alone writes
    assert abs((tmp_path / "tied.pth").stat().st_size - (tmp_path / "in_line.pth").stat().st_size) < 4096


def test_host_copy_copies_every_tensor_and_keeps_the_structure():
    state = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": {"c": torch.arange(3)}, "d": "text"}
    copied = host_copy(state)
    assert copied["a"][1][1] == 3 and isinstance(copied["a"][1], tuple) and copied["d"] == "text"
    for original, copy in ((state["a"][0], copied["a"][0]), (state["b"]["c"], copied["b"]["c"])):
        assert torch.equal(original, copy) and copy.data_ptr() != original.data_ptr()


def test_check_raises_a_failed_write_once_it_has_ended_and_never_blocks(tmp_path, monkeypatch):
    release = threading.Event()

    def fails_when_released(state, path):
        assert release.wait(30), "the test never released the write"
        raise CheckpointWriteError(f"could not write checkpoint {path}")

    monkeypatch.setattr(engine.checkpoint.writer, "save_checkpoint", fails_when_released)
    writer = CheckpointWriter()
    writer.save({"model": {}}, tmp_path / "checkpoint.pth")
    writer.check()  # in flight: nothing to raise yet, and no wait
    assert writer.writing
    release.set()
    writer._thread.join(30)
    with pytest.raises(CheckpointWriteError, match="could not write checkpoint"):
        writer.check()
    writer.check()  # raised once
