"""The run's checkpoints: checkpoint.pth is rewritten at each epoch's end (also kept as checkpoint_epochNNNN.pth every
``checkpoint_every`` epochs), mid-epoch every ``checkpoint_minutes`` once a log interval's losses are checked, and at
a stop. Rank 0 writes in the background (engine/checkpoint/writer.py): the state is copied to host memory and
training goes on.

A checkpoint holds the training's state (``model``, ``optimizer``, ``lr_scheduler``, ``grad_scaler``), the position
(``epoch``, ``steps_in_epoch``, ``step``, ``rng``, ``step_images``, and ``pending_evaluation`` when a stop
interrupted one), what the run records (``config``, ``categories``) and each hook's share under its key (``ema``).
"""

from __future__ import annotations

import time

from engine.checkpoint.io import LATEST, check_free_space, checkpoint_bytes, epoch_checkpoint_name
from engine.checkpoint.writer import CheckpointWriter
from engine.runtime.rng import capture_rng_state

from .base import Ending, EpochEnd, Hook, StepDone


class CheckpointSaver(Hook):
    """Writes the run's state (rank 0 only); every method may be called on every rank.

    training  the training's parts by checkpoint key: "model" (the unwrapped model), "optimizer", "lr_scheduler",
              "grad_scaler", each with state_dict()
    record    what every checkpoint records besides: "config" (the run's, plain) and "categories" (id -> name,
              with which predict.py and export.py name the classes)
    every     epochs between the kept checkpoint_epochNNNN.pth files
    minutes   also rewrite checkpoint.pth mid-epoch after this many minutes (None: at epoch ends only)
    """

    def __init__(self, *, training: dict, record: dict, every: int, minutes: float | None):
        self.training, self.record, self.every, self.minutes = training, record, every, minutes
        self.writer = CheckpointWriter()
        self._last_save = time.monotonic()
        self._recorded_pending: dict | None = None  # the evaluation the last checkpoint asks a resume to run first

    def start(self, run) -> None:
        if run.ctx.is_main:  # a full disk is found now, not at the end of an epoch of training
            shares = 1 + len(run.checkpoint_shares())  # the model EMA is a copy of the weights
            check_free_space(run.output_dir, checkpoint_bytes(self.training["model"]) * shares)
        self._recorded_pending = run.position.pending_evaluation

    def before_step(self, run, number: int) -> bool:
        if self._asks_for_evaluation_run(run):
            self.save(run, epoch_done=False)  # the resumed checkpoint's pending evaluation has run
            return True
        return False

    def after_step(self, run, done: StepDone) -> bool:
        """Mid-epoch, only where a log interval has just checked the losses up to this step: a checkpoint holds no
        step with a non-finite loss."""
        if run.metrics.checked_step != done.number:
            return False
        self.writer.check()  # raises the error of a write that has ended; never blocks
        if not self._due(run):
            return False
        self.save(run, epoch_done=False)
        return True

    def epoch_end(self, run, end: EpochEnd) -> bool:
        self.save(run, epoch_done=end.complete)
        return True

    def close(self, run, ending: Ending) -> None:
        if ending is Ending.STOPPED or (ending is Ending.DONE and self._asks_for_evaluation_run(run)):
            self.save(run, epoch_done=False)
        if ending is Ending.FAILED:  # already failing: a write error is logged, not raised over the first
            self.writer.wait_quietly()
        else:
            run.timing.checkpoint_s += self.writer.wait()  # a stop's message says the file holds this step

    def save(self, run, *, epoch_done: bool) -> None:
        """checkpoint.pth at the run's position (and the epoch's own file when one is due), with the evaluation a
        stop interrupted, if any, for the resume to run first."""
        position = run.position
        if run.ctx.is_main:
            state = {key: part.state_dict() for key, part in self.training.items()}
            state.update(
                epoch=position.epoch,
                steps_in_epoch=position.steps_in_epoch,
                step=position.step,
                rng=capture_rng_state(),
                # for a resume with another total batch to count the steps done (resume.py, position_in_this_run)
                step_images=run.plan.batch.total,
                **self.record,
            )
            state.update({key: hook.state_dict() for key, hook in run.checkpoint_shares().items()})
            if position.pending_evaluation is not None:
                state["pending_evaluation"] = position.pending_evaluation
            latest = run.output_dir / LATEST
            epoch_file = epoch_done and position.epoch % self.every == 0  # published as latest once written
            path = run.output_dir / epoch_checkpoint_name(position.epoch) if epoch_file else latest
            run.timing.checkpoint_s += self.writer.save(state, path, also_as=latest if epoch_file else None)
        self._recorded_pending = position.pending_evaluation
        self._last_save = time.monotonic()

    def _asks_for_evaluation_run(self, run) -> bool:
        """The last checkpoint asks a resume to run an evaluation that this run has run since."""
        return self._recorded_pending is not None and run.position.pending_evaluation is None

    def _due(self, run) -> bool:
        """Mid-epoch, ``minutes`` since the last save (rank 0 alone: it writes, no collective)."""
        return (
            run.ctx.is_main
            and self.minutes is not None
            and time.monotonic() - self._last_save >= 60 * self.minutes
            and run.position.steps_in_epoch < run.plan.steps_per_epoch
        )


def restore_checkpoint_shares(run, ckpt: dict) -> None:
    """Give each hook with a share of the checkpoint what the resumed ``ckpt`` holds under its key; a hook whose
    key the checkpoint lacks (turned on at the resume) keeps its fresh state."""
    for key, hook in run.checkpoint_shares().items():
        if key in ckpt:
            hook.load_state_dict(ckpt[key])
