"""Checkpoints written while the run goes on training.

A save takes a host copy of the state at once (the next optimizer step changes the weights in place) and
hands it to a writer thread, which writes it with ``save_checkpoint`` (a temporary file renamed when
complete). torch.save's writes and the fsync release the GIL, so the steps go on meanwhile; on a short
fine-tune, epochs of a few seconds no longer wait a second each for the disk. One write is in flight at
most: the next save, a stop and the end of the run wait for it, and its error is raised there, or at the
first ``check`` after the write failed (the loop checks at each log interval: a full disk stops the run
within an interval, not an epoch later). A run killed mid-write keeps the previous checkpoint, whole.
"""

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
    """``obj`` with every tensor copied to host memory (a copy even of host tensors: the optimizer updates
    them in place); dicts, lists and tuples are rebuilt around the copies, anything else is shared. Tensors
    that are the same view of one storage (tied weights: the shared heads of the prediction layers) get one
    copy, so that torch.save still writes them once."""
    copies = {} if _copies is None else _copies
    if torch.is_tensor(obj):
        key = (obj.device, obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.stride(),
               obj.dtype)
        if key not in copies or obj.numel() == 0:
            copies[key] = obj.detach().to("cpu", copy=True)
        return copies[key]
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v, copies)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, copies) for v in obj)
    return obj


class CheckpointWriter:
    """``save`` returns once the state is copied; ``wait`` blocks until the file is on disk and raises the
    write's error."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: dict, path: str | os.PathLike, *, also_as: str | os.PathLike | None = None) -> float:
        """Write ``state`` to ``path`` (and publish it under ``also_as`` once written); the seconds the caller
        was held (waiting for the previous write, copying the state)."""
        t0 = time.perf_counter()
        self.wait()
        snapshot = host_copy(state)
        # Not a daemon: a process that exits with a write in flight finishes it first.
        self._thread = threading.Thread(target=self._write, args=(snapshot, Path(path), also_as),
                                        name="checkpoint-writer")
        self._thread.start()
        return time.perf_counter() - t0

    def wait(self) -> float:
        """Block until the write in flight is on disk; raise its error. The seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()
        return time.perf_counter() - t0

    def check(self) -> None:
        """Raise the error of a write that has ended; never blocks."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait_quietly(self) -> None:
        """``wait`` for a run that is already failing: a write error is logged, not raised over the first. An error
        raised into the wait from elsewhere (a second loader worker's death, which torch's SIGCHLD handler raises
        in this thread) is not the write's: the wait goes on, so that the process never ends with a write in flight."""
        while True:
            try:
                self.wait()
                return
            except Exception as error:  # noqa: BLE001 - the run's own error is the one to report
                if self._thread is None:  # wait() had joined the thread: the write's own error
                    log.error("%s", error)
                    return

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _write(self, state: dict, path: Path, also_as) -> None:
        try:
            saved = save_checkpoint(state, path)
            if also_as is not None:
                publish_as(saved, also_as)
        except BaseException as error:  # noqa: BLE001 - handed to the thread that waits
            self._error = error

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
