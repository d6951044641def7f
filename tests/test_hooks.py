"""The loop's hooks (engine/train/hooks/base.py): a hook that is not part of the project, added to a run's list, sees
every event in order across an epoch's end, a checkpoint, an evaluation, a stop signal and the resume after it."""

from __future__ import annotations

import signal

import pytest
from helpers import compose_run, signal_at_call

import train as trainer
from engine.runtime.stop_request import TrainingStopped
from engine.train.hooks.base import Ending, EpochEnd, Hook, StepDone
from engine.train.run import RunHooks

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 3  # helpers.tiny_overrides: 16 images in batches of 4, one batch left over in the size buckets


class Recorder(Hook):
    """Records each event it is called with, and what the run directory held at each epoch's end."""

    def __init__(self, run_dir):
        self.run_dir, self.events = run_dir, []

    def start(self):
        self.events.append(("start",))

    def before_step(self, number: int):
        self.events.append(("before_step", number))

    def after_step(self, done: StepDone):
        self.events.append(("after_step", done.number, done.epoch, tuple(done.values.shape)))

    def epoch_end(self, end: EpochEnd):
        # The hooks before this one wrote the epoch's checkpoint (being written, or written) and its evaluation.
        evaluated = (self.run_dir / f"eval_epoch{end.epoch + 1:04d}.json").is_file()
        self.events.append(("epoch_end", end.epoch, end.complete, evaluated))

    def pause(self):
        self.events.append(("pause",))

    def close(self, ending: Ending):
        self.events.append(("close", ending.value))


@pytest.fixture
def recorded(monkeypatch):
    """Every run made in the test gets a Recorder last in its list of hooks; yields the recorders, one per run."""
    recorders = []
    ordered = RunHooks.ordered

    def with_recorder(hooks: RunHooks):
        recorders.append(Recorder(hooks.saver.output_dir))
        return [*ordered(hooks), recorders[-1]]

    monkeypatch.setattr(RunHooks, "ordered", with_recorder)
    return recorders


def steps(first: int, last: int, epoch: int, values: tuple) -> list[tuple]:
    return [
        event
        for number in range(first, last + 1)
        for event in (("before_step", number), ("after_step", number, epoch, values))
    ]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


def test_a_hook_of_ones_own_sees_every_event_in_order_through_a_stop_and_its_resume(
    data_root, tmp_path, monkeypatch, recorded
):
    stop_at = STEPS_PER_EPOCH + 1  # the second epoch's first step (the resumed run's steps do not count it again)
    signal_at_call(monkeypatch, signal.SIGTERM, stop_at)
    with pytest.raises(TrainingStopped):
        trainer.train(compose_run(data_root, tmp_path, "epochs=2", "eval_images=0"))
    trainer.train(compose_run(data_root, tmp_path, "epochs=2", "eval_images=0", "resume=auto"))

    stopped, resumed = (recorder.events for recorder in recorded)
    values = stopped[3][3]  # the shape of the step's result vector: the loss, the gradient norm and each loss
    assert stopped == [
        ("start",),
        ("pause",),
        *steps(1, STEPS_PER_EPOCH, 0, values),
        ("epoch_end", 0, True, True),
        ("pause",),  # the checkpoint and the evaluation were no step
        ("pause",),
        *steps(stop_at, stop_at, 1, values),  # the next epoch starts
        ("close", "stopped"),
        ("close", "failed"),
    ]  # the stop's checkpoint; then the cleanup
    assert resumed == [
        ("start",),
        ("pause",),
        *steps(stop_at + 1, 2 * STEPS_PER_EPOCH, 1, values),
        ("epoch_end", 1, True, True),
        ("pause",),
        ("close", "done"),
    ]
