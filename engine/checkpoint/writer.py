"""Checkpoints written by a thread while training goes on (torch.save and fsync release the GIL), from a host copy
taken at once (the next step changes the weights in place). One write is in flight at most: the next save, a stop
and the end of the run wait for it and raise its error, as does the first ``check`` after it failed."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

from .io import publish_as, save_checkpoint

log = logging.getLogger(__name__)


def host_copy(obj, _copies: dict | None = None):
    """``obj`` with every tensor copied to host memory, even host tensors (updated in place); dicts, lists and tuples
    rebuilt, anything else shared. Identical views (tied weights) get one copy, so torch.save writes them once."""
    copies = {} if _copies is None else _copies
    if torch.is_tensor(obj):
        key = (
            obj.device,
            obj.untyped_storage().data_ptr(),
            obj.storage_offset(),
            tuple(obj.shape),
            obj.stride(),
            obj.dtype,
        )
        if key not in copies or obj.numel() == 0:
            copies[key] = obj.detach().to("cpu", copy=True)
        return copies[key]
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v, copies)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, copies) for v in obj)
    return obj


class CheckpointWriter:
    """``save`` returns once the state is copied; ``wait`` blocks until the file is on disk and raises its error."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._written = threading.Event()
        self._error: BaseException | None = None

    def save(self, state: dict, path: str | os.PathLike, *, also_as: str | os.PathLike | None = None) -> float:
        """Write ``state`` to ``path`` (and publish it under ``also_as`` once written); the seconds the caller
        was held (waiting for the previous write, copying the state)."""
        t0 = time.perf_counter()
        self.wait()
        self._written.clear()
        # Not a daemon: a process that exits with a write in flight finishes it first.
        self._thread = threading.Thread(
            target=self._write, args=(host_copy(state), Path(path), also_as), name="checkpoint-writer"
        )
        self._thread.start()
        return time.perf_counter() - t0

    def wait(self) -> float:
        """Block until the write in flight is on disk; raise its error. The seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            # The write's end, then the thread's: an exception a signal handler raises into Thread.join (a dead loader
            # worker's) can make Python 3.11 take the running thread for ended, and its exit then aborts mid-write.
            self._written.wait()
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return time.perf_counter() - t0

    def check(self) -> None:
        """Raise the error of a write that has ended; never blocks."""
        if self._thread is not None and self._written.is_set():
            self.wait()

    def wait_quietly(self) -> None:
        """``wait`` for a run already failing: a write error is logged, not raised. An error raised into the wait from
        elsewhere (torch's SIGCHLD handler on a loader worker's death) does not end it: no write is left in flight."""
        while True:
            try:
                self.wait()
                return
            except Exception as error:  # the run's own error is the one to report
                if self._thread is None:  # wait() had joined the thread: the write's own error
                    log.error("%s", error)
                    return

    @property
    def writing(self) -> bool:
        return self._thread is not None and not self._written.is_set()

    def _write(self, state: dict, path: Path, also_as) -> None:
        try:
            saved = save_checkpoint(state, path)
            if also_as is not None:
                publish_as(saved, also_as)
        except BaseException as error:  # handed to the thread that waits
            self._error = error
        finally:
            self._written.set()
