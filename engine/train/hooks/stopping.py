"""When a stop signal stops training: every process at the same step, after that step is saved. The signal handler
only sets a flag (engine/runtime/stop_request.py). One process acts on its own flag at once; several learn of any
one's request in the log interval's all-reduce (interval_report.py), with no sync of their own.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path

from engine.runtime.stop_request import StopRequest, TrainingStopped

from ..run_plan import Position
from .base import Ending, Hook, StepDone, StopRequested

log = logging.getLogger(__name__)


class StopControl(Hook):
    """Whether the run stops after the current step (StopRequested), and the TrainingStopped that ends its STOPPED
    close, once the hooks before it have saved ``position`` into ``latest``."""

    def __init__(
        self,
        request: StopRequest,
        *,
        distributed: bool,
        is_main: bool,
        any_process: Callable[[bool], bool] = bool,
        position: Position | None = None,
        total_steps: int = 0,
        latest: Path | None = None,
    ):
        self.request, self.distributed, self.is_main = request, distributed, is_main
        self.position, self.total_steps, self.latest = position, total_steps, latest
        self.any_process = any_process  # whether any process says so (a collective on several)
        self.agreed = False  # every process has learnt of a stop request (at a log interval)

    def heard(self, any_process_requested: bool) -> None:
        """A log interval's verdict: some process was asked to stop."""
        self.agreed = self.agreed or any_process_requested

    def after_step(self, done: StepDone) -> None:
        if self.due():
            raise StopRequested

    def close(self, ending: Ending) -> None:
        if ending is Ending.STOPPED:
            pending = self.position.pending_evaluation
            raise self.stopped(
                epoch=self.position.epoch,
                step=self.position.step,
                total_steps=self.total_steps,
                latest=self.latest,
                evaluation=pending["epoch"] if pending else None,
            )

    def due(self) -> bool:
        """Stop after this step: announced once, then acted on where every process knows of it."""
        # Read before announcing: a signal landing between the two is announced now and acted on at the next step,
        # never acted on unannounced.
        requested = self.request.requested
        self.request.announce()
        return self.agreed or (requested and not self.distributed)

    def during_evaluation(self, final: bool) -> bool:
        """Asked after each evaluation batch, and (``final``) after the last: stop now. One process stops at the next
        batch; several learn of any one's request once their passes are over, before gathering their detections
        (their shares may run different numbers of batches, so a collective per batch could pair up wrongly)."""
        requested = self.request.requested  # read before announcing, as in due()
        self.request.announce(evaluating=True)
        if self.distributed and not final:
            return False
        return self.any_process(requested)

    def stopped(
        self, *, epoch: int, step: int, total_steps: int, latest: Path, evaluation: int | None = None
    ) -> TrainingStopped:
        """The exception to raise once ``latest`` holds ``step`` (``evaluation``: during the evaluation after that
        epoch, which a resume runs first); rank 0 logs where to go on from."""
        self.request.announce(evaluating=evaluation is not None)  # announced before the stop it caused
        signum = self.request.signum if self.request.signum is not None else int(signal.SIGTERM)
        by = signal.Signals(signum).name if self.request.requested else "another process"
        where = (
            f"during the evaluation after epoch {evaluation}, at step {step} of {total_steps}"
            if evaluation is not None
            else f"at epoch {epoch + 1}, step {step} of {total_steps}"
        )
        message = (
            f"stopped by {by} {where}: {latest} holds that step; continue with resume=auto (in this run "
            f"directory) or resume={latest}" + (", which evaluates first" if evaluation is not None else "")
        )
        if self.is_main:
            log.warning(message)
        return TrainingStopped(signum, message)
