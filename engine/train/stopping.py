"""When a stop signal stops training: every process at the same step, after that step is saved.

The signal handler only sets a flag (engine/runtime/stop_request.py). One process acts on its own flag at once;
several processes learn of any process's request in the log interval's all-reduce (engine/train/step_log.py),
so that every rank stops at the same step without a sync of its own.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from engine.runtime.stop_request import StopRequest, TrainingStopped

log = logging.getLogger("train")


class StopControl:
    """Whether the run stops after the current step, and the message and exception it stops with."""

    def __init__(self, request: StopRequest, *, distributed: bool, is_main: bool):
        self.request = request
        self.distributed = distributed
        self.is_main = is_main
        self.agreed = False  # every process has learnt of a stop request (at a log interval)

    @property
    def requested_here(self) -> bool:
        return self.request.requested

    def heard(self, any_process_requested: bool) -> None:
        """A log interval's verdict: some process was asked to stop."""
        self.agreed = self.agreed or any_process_requested

    def due(self) -> bool:
        """Stop after this step: announced once, then acted on where every process knows of it."""
        self.request.announce()
        return self.agreed or (self.request.requested and not self.distributed)

    def stopped(self, *, epoch: int, step: int, total_steps: int, latest: Path) -> TrainingStopped:
        """The exception to raise once ``latest`` holds ``step``; rank 0 logs where to go on from."""
        signum = self.request.signum if self.request.signum is not None else int(signal.SIGTERM)
        by = signal.Signals(signum).name if self.request.requested else "another process"
        message = (f"stopped by {by} at epoch {epoch + 1}, step {step} of {total_steps}: {latest} holds that step; "
                   f"continue with resume=auto (in this run directory) or resume={latest}")
        if self.is_main:
            log.warning(message)
        return TrainingStopped(signum, message)
