"""Whether a run stops on a stop signal, and when: every process at the same step, after that step is saved. The
signal handler only sets a flag (engine/runtime/stop_request.py). One process acts on its own flag at once; several
learn of any one's request in the log interval's all-reduce (hooks/interval_report.py), with no sync of their own.
``RunStop`` is part of the run's shared state (hooks/base.py); the stop control hook (hooks/stopping.py) acts on it.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from engine.runtime.distributed import DistContext, any_process
from engine.runtime.stop_request import StopRequest, TrainingStopped

log = logging.getLogger(__name__)


class RunStop:
    """The stop signals of a run on the processes of ``ctx``: whether it stops after the current step (``due``), or
    during an evaluation, and the TrainingStopped that ends it."""

    def __init__(self, request: StopRequest, ctx: DistContext):
        self.request, self.ctx = request, ctx
        self.agreed = False  # every process has learnt of a stop request (at a log interval)

    @property
    def requested(self) -> bool:
        """This process was sent a stop signal."""
        return self.request.requested

    def heard(self, any_process_requested: bool) -> None:
        """A log interval's verdict: some process was asked to stop."""
        self.agreed = self.agreed or any_process_requested

    def due(self) -> bool:
        """Stop after this step: announced once, then acted on where every process knows of it."""
        # Read before announcing: a signal landing between the two is announced now and acted on at the next step,
        # never acted on unannounced.
        requested = self.request.requested
        self.request.announce()
        return self.agreed or (requested and not self.ctx.distributed)

    def during_evaluation(self, final: bool) -> bool:
        """Asked after each evaluation batch, and (``final``) after the last: stop now. One process stops at the next
        batch; several learn of any one's request once their passes are over, before gathering their detections
        (their shares may run different numbers of batches, so a collective per batch could pair up wrongly)."""
        requested = self.request.requested  # read before announcing, as in due()
        self.request.announce(evaluating=True)
        if not self.ctx.distributed:
            return requested
        return final and any_process(requested, self.ctx)

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
        if self.ctx.is_main:
            log.warning(message)
        return TrainingStopped(signum, message)
