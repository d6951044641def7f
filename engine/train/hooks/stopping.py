"""The stop control: after a step, the run stops when its stop state says so (engine/train/run_stop.py); a stopped
run ends, once the hooks before this one have saved its position, with the TrainingStopped that says where to go on
from."""

from __future__ import annotations

from engine.checkpoint.io import LATEST

from .base import Ending, Hook, StepDone, StopRequested


class StopControl(Hook):
    """Last in the list: every hook before it has seen the step, or saved the stopped run's position."""

    def after_step(self, run, done: StepDone) -> None:
        if run.stop.due():
            raise StopRequested

    def close(self, run, ending: Ending) -> None:
        if ending is Ending.STOPPED:
            pending = run.position.pending_evaluation
            raise run.stop.stopped(
                epoch=run.position.epoch,
                step=run.position.step,
                total_steps=run.plan.total_steps,
                latest=run.output_dir / LATEST,
                evaluation=pending["epoch"] if pending else None,
            )
