"""The loop's hooks (engine/train/hooks/base.py): a hook that is not part of the project, added to a run through
``train(cfg, hooks=[...])``, sees every event in order, with the run's shared state, across an epoch's end, a
checkpoint, an evaluation, a stop signal and the resume after it; the run is closed once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import compose_run

import train as trainer
from engine.runtime.stop_request import TrainingStopped
from engine.train.hooks.base import Ending, EpochEnd, Hook, StepDone

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 3  # helpers.tiny_overrides: 16 images in batches of 4, one batch left over in the size buckets


class Recorder(Hook):
    """Records each event it is called with and what the run's state says then; sends itself SIGTERM before step
    ``signal_before`` (None: never), as a scheduler would."""

    def __init__(self, signal_before: int | None = None):
        self.signal_before, self.events = signal_before, []

    def start(self, run):
        self.events.append(("start", run.position.step, run.resumed_from is not None))

    def before_step(self, run, number: int):
        if number == self.signal_before:
            os.kill(os.getpid(), signal.SIGTERM)
        self.events.append(("before_step", number))

    def after_step(self, run, done: StepDone):
        assert run.position.step == done.number and done.names[:2] == ("loss", "grad_norm")
        self.events.append(("after_step", done.number, done.epoch, tuple(done.values.shape)))

    def epoch_end(self, run, end: EpochEnd):
        # The hooks before this one saved the epoch (checkpoint.pth is written, or being written) and evaluated it.
        evaluated = run.metrics.evaluation is not None
        written = (run.output_dir / f"eval_epoch{end.epoch + 1:04d}.json").is_file()
        self.events.append(("epoch_end", end.epoch, end.complete, evaluated and written))

    def pause(self, run):
        self.events.append(("pause",))

    def close(self, run, ending: Ending):
        self.events.append(("close", ending.value, run.position.step))


def steps(first: int, last: int, epoch: int, values: tuple) -> list[tuple]:
    return [
        event
        for number in range(first, last + 1)
        for event in (("before_step", number), ("after_step", number, epoch, values))
    ]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


def test_a_hook_of_ones_own_sees_every_event_in_order_through_a_stop_and_its_resume(data_root, tmp_path):
    stop_at = STEPS_PER_EPOCH + 1  # the second epoch's first step (the resumed run's steps do not count it again)
    stopped, resumed = Recorder(signal_before=stop_at), Recorder()
    with pytest.raises(TrainingStopped):
        trainer.train(compose_run(data_root, tmp_path, "epochs=2", "eval_images=0"), hooks=[stopped])
    trainer.train(compose_run(data_root, tmp_path, "epochs=2", "eval_images=0", "resume=auto"), hooks=[resumed])

    values = stopped.events[3][3]  # the shape of the step's result vector: the loss, the gradient norm and each loss
    assert stopped.events == [
        ("start", 0, False),
        ("pause",),
        *steps(1, STEPS_PER_EPOCH, 0, values),
        ("epoch_end", 0, True, True),
        ("pause",),  # the checkpoint and the evaluation were no step
        ("pause",),
        *steps(stop_at, stop_at, 1, values),  # the next epoch starts
        ("close", "stopped", stop_at),  # the stop's checkpoint, and no other close
    ]
    assert resumed.events == [
        ("start", stop_at, True),
        ("pause",),
        *steps(stop_at + 1, 2 * STEPS_PER_EPOCH, 1, values),
        ("epoch_end", 1, True, True),
        ("pause",),
        ("close", "done", 2 * STEPS_PER_EPOCH),
    ]


class Counter(Hook):
    """A hook with a share of the checkpoint: the steps it has seen, over a stop and its resume."""

    checkpoint_key = "counter"

    def __init__(self, signal_before: int | None = None):
        self.seen, self.signal_before = 0, signal_before

    def before_step(self, run, number: int):
        if number == self.signal_before:
            os.kill(os.getpid(), signal.SIGTERM)

    def after_step(self, run, done: StepDone):
        self.seen += 1

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def test_a_hooks_share_of_the_checkpoint_is_saved_and_given_back_at_the_resume(data_root, tmp_path):
    from engine.checkpoint.io import load_checkpoint

    with pytest.raises(TrainingStopped):
        trainer.train(compose_run(data_root, tmp_path, "eval_images=0"), hooks=[Counter(signal_before=2)])
    assert load_checkpoint(tmp_path / "checkpoint.pth")["counter"] == {"seen": 2}
    counter = Counter()
    trainer.train(compose_run(data_root, tmp_path, "eval_images=0", "resume=auto"), hooks=[counter])
    assert counter.seen == 2 * STEPS_PER_EPOCH
    assert load_checkpoint(tmp_path / "checkpoint.pth")["counter"] == {"seen": 2 * STEPS_PER_EPOCH}


def test_two_hooks_cannot_keep_their_state_under_one_key(data_root, tmp_path):
    with pytest.raises(ValueError, match=r"two hooks keep their state under the checkpoint key 'counter'"):
        trainer.train(compose_run(data_root, tmp_path, "eval_images=0"), hooks=[Counter(), Counter()])


HOOKS = Path(__file__).resolve().parents[1] / "engine" / "train" / "hooks"


def _hook_classes() -> list[type]:
    import importlib

    classes = []
    for path in sorted(HOOKS.glob("*.py")):
        module = importlib.import_module(f"engine.train.hooks.{path.stem}")
        classes += [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, Hook) and c is not Hook]
    return sorted(set(classes), key=lambda c: c.__name__)


def test_every_hooks_constructor_takes_at_most_four_parameters():
    import inspect

    found = {c.__name__: len(inspect.signature(c.__init__).parameters) - 1 for c in _hook_classes()}
    assert {"CheckpointSaver", "EpochEvaluation", "IntervalReporter", "ModelEma", "StepProfiler"} <= set(found)
    assert {name: count for name, count in found.items() if count > 4} == {}


def test_no_hook_reaches_into_another():
    """A hook module imports nothing of its package but the Hook protocol (base.py), and no hook reads the run's list
    of hooks, which the run's state alone goes through (base.py, RunState): hooks meet only through that state."""
    import ast

    problems = []
    for path in sorted(HOOKS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in ("base", None):
                problems.append(f"{path.name}:{node.lineno} imports .{node.module}")
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                problems.append(f"{path.name}:{node.lineno} imports from its package")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine.train.hooks"):
                problems.append(f"{path.name}:{node.lineno} imports {node.module}")
            if isinstance(node, ast.Attribute) and node.attr == "hooks" and path.name != "base.py":
                problems.append(f"{path.name}:{node.lineno} reads .hooks")
    assert problems == []
