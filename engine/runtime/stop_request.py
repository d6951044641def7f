"""Stopping a run cleanly on SIGTERM (preemption notice), SIGINT (Ctrl-C) or SIGUSR1 (SLURM's ``--signal=USR1@120``):
``StopRequest`` turns them into a flag the loop reads between steps; it saves the exact position and exits with
128 + the signal's number. A second Ctrl-C stops at once. Loader workers ignore the signals (``ignore_stop_signals``),
so a Ctrl-C to the process group does not kill them under the step being finished.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGINT", "SIGUSR1")) if s is not None)
STOPPED_EXIT_CODE = {int(s): 128 + int(s) for s in STOP_SIGNALS}


class TrainingStopped(Exception):
    """The run stopped on a signal after saving its checkpoint; ``exit_code`` is the process's documented code."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = STOPPED_EXIT_CODE.get(signum, 1)


class StopRequest:
    """While active (a context manager, main thread only), the first stop signal sets ``signum``."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._announced = False

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        # Only a flag: logging here could re-enter a console write the signal interrupted (the loop calls announce).
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        if self.signum is None:
            self.signum = signum

    def announce(self, *, evaluating: bool = False) -> None:
        """Log the request, once; ``evaluating``: seen between an evaluation's batches, which it stops."""
        if self.signum is not None and not self._announced:
            self._announced = True
            doing = (
                "stopping this evaluation, then writing checkpoint.pth, whose resume runs it first, and stopping"
                if evaluating
                else "finishing this step, then writing checkpoint.pth and stopping"
            )
            log.warning(
                "%s received: %s%s",
                signal.Signals(self.signum).name,
                doing,
                " (Ctrl-C again to stop at once)" if self.signum == signal.SIGINT else "",
            )


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A DataLoader worker_init_fn: the stop signals are the main process's to act on."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
