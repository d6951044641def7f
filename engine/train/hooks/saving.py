"""The run's checkpoints: checkpoint.pth is rewritten at each epoch's end (also kept as checkpoint_epochNNNN.pth every
``checkpoint_every`` epochs), mid-epoch every ``checkpoint_minutes`` at a log interval's end, and at a stop. Rank 0
writes in the background (engine/checkpoint/writer.py): the state is copied to host memory and training goes on.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.checkpoint.io import LATEST, check_free_space, checkpoint_bytes, epoch_checkpoint_name
from engine.checkpoint.writer import CheckpointWriter
from engine.runtime.rng import capture_rng_state

from ..run_plan import Position, RunPlan
from .base import Ending, EpochEnd, Hook, StepDone
from .timing import RunTiming


class CheckpointSaver(Hook):
    """Writes the training's state (rank 0 only); every method may be called on every rank. ``categories`` (id ->
    name) lets predict.py and export.py name the classes; ``extra_state`` maps a key to an object with
    ``state_dict()`` (model EMA), saved under that key and restored by resume."""

    def __init__(
        self,
        *,
        output_dir: Path,
        is_main: bool,
        model: torch.nn.Module,
        optimizer,
        lr_scheduler,
        scaler,
        config_record: dict,
        categories: dict,
        checkpoint_every: int,
        checkpoint_minutes: float | None,
        timing: RunTiming,
        position: Position,
        plan: RunPlan,
        extra_state: dict | None = None,
    ):
        self.output_dir, self.is_main = Path(output_dir), is_main
        self.latest = self.output_dir / LATEST
        self.model, self.optimizer, self.lr_scheduler, self.scaler = model, optimizer, lr_scheduler, scaler
        self.config_record, self.categories = config_record, categories
        self.checkpoint_every, self.checkpoint_minutes = checkpoint_every, checkpoint_minutes
        self.timing, self.position, self.plan = timing, position, plan
        self.extra_state = extra_state or {}
        if is_main:  # a full disk is found now, not at the end of an epoch of training
            check_free_space(self.output_dir, checkpoint_bytes(model) * (1 + len(self.extra_state)))
        self.writer = CheckpointWriter()
        self._last_save = time.monotonic()

    def after_step(self, done: StepDone) -> bool:
        """At a log interval's end (its losses checked: a checkpoint holds no step with a non-finite loss)."""
        if not self.plan.due_for_log(done.number):
            return False
        self.writer.check()  # raises the error of a write that has ended; never blocks
        if not self.due():
            return False
        self.save(epoch_done=False)
        return True

    def epoch_end(self, end: EpochEnd) -> bool:
        self.save(epoch_done=end.complete)
        return True

    def close(self, ending: Ending) -> None:
        if ending is Ending.STOPPED:
            self.save(epoch_done=False)
            self.wait()  # the stop's message says the file holds this step
        elif ending is Ending.DONE:
            self.wait()
        else:  # already failing: a write error is logged, not raised over the first
            self.writer.wait_quietly()

    def save(self, *, epoch_done: bool) -> None:
        """checkpoint.pth at the position (and the epoch's own file when one is due), with the evaluation a stop
        interrupted, if any, for the resume to run first."""
        position = self.position
        if self.is_main:
            state = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "grad_scaler": self.scaler.state_dict(),
                "epoch": position.epoch,
                "steps_in_epoch": position.steps_in_epoch,
                "step": position.step,
                "config": self.config_record,
                "categories": self.categories,
                "rng": capture_rng_state(),
                # for a resume with another total batch to count the steps done (resume.py, position_in_this_run)
                "step_images": self.plan.batch.total,
                **{key: part.state_dict() for key, part in self.extra_state.items()},
            }
            if position.pending_evaluation is not None:
                state["pending_evaluation"] = position.pending_evaluation
            epoch_file = epoch_done and position.epoch % self.checkpoint_every == 0  # published as latest once written
            path = self.output_dir / epoch_checkpoint_name(position.epoch) if epoch_file else self.latest
            self.timing.checkpoint_s += self.writer.save(state, path, also_as=self.latest if epoch_file else None)
        self._last_save = time.monotonic()

    def due(self) -> bool:
        """Mid-epoch, ``checkpoint_minutes`` since the last save (rank 0 alone: it writes, no collective)."""
        minutes = self.checkpoint_minutes
        return (
            self.is_main
            and minutes is not None
            and time.monotonic() - self._last_save >= 60 * minutes
            and self.position.steps_in_epoch < self.plan.steps_per_epoch
        )

    def wait(self) -> None:
        """Until the write in flight is on disk (its error raised); the time counts as the checkpoint's."""
        self.timing.checkpoint_s += self.writer.wait()

    def describe_kept(self) -> str:
        """What a run stopped without saving keeps, for its message (once any write in flight has ended)."""
        self.writer.wait_quietly()
        return (
            f"the last good checkpoint, {self.latest}, is kept (resume={self.latest})"
            if self.latest.exists()
            else "no checkpoint had been written yet"
        )
