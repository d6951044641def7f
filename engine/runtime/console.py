"""One message per fault, and the exit codes.

``run_reporting_faults`` runs a job the way train.py's users meet it. A fault the user can fix (a setting, a
path, a data file, a checkpoint, a full disk, another run in the directory: engine.errors.USER_FAULTS) is one
message on the console, without a traceback or the internal exceptions behind it; the traceback goes to
train.log (and to the console too with HYDRA_FULL_ERROR=1). The exit codes (docs/resume-and-faults.md): 0 done;
1 a fault; 128 + N stopped by signal N after saving its step (143 SIGTERM, 130 SIGINT, 138 SIGUSR1); 130 also
for a second Ctrl-C, which stops at once. Anything else is a bug: its traceback goes to train.log and Hydra
prints it once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from engine.errors import USER_FAULTS, UserError
from engine.reporting.log_filter import FILE_ONLY

from .run_lock import LOCK_FILE
from .stop_request import TrainingStopped

FAULT_EXIT_CODE = 1
INTERRUPTED_EXIT_CODE = 130
# What a run directory holds before the job writes anything: Hydra's record and log (named after the script),
# and the run's lock.
HYDRA_FILES = {".hydra", "train.log", "predict.log", "export.log", LOCK_FILE}
# The name torch's DataLoader gives (through its target) the thread that pins batches on a GPU run.
PIN_MEMORY_THREAD = "_pin_memory_loop"
T = TypeVar("T")


def run_reporting_faults(job: Callable[[], object], *, run_dir: Path | None, log: logging.Logger,
                         dated: bool = False,
                         interrupted: str = "stopped at once by a second Ctrl-C: the steps since the last checkpoint "
                                            "are lost") -> None:
    """Run ``job`` (see the module docstring): returns when it succeeds, else exits or re-raises.

    run_dir  Hydra's run directory, removed if the job failed before writing anything into it; ``dated``: it is
             outputs/<date>/<time>, whose date and outputs folders go too when that leaves them empty
    interrupted  the message for a KeyboardInterrupt (a job without stop signals of its own gets it at once)
    """
    # Kept while the handlers below end the loader's workers too: a pin-memory thread can die of that.
    with loader_thread_tracebacks_to_log(log):
        try:
            job()
        except TrainingStopped as stopped:  # the loop has logged where to resume from
            end_child_processes()
            sys.exit(stopped.exit_code)
        except KeyboardInterrupt:
            log.error("%s", interrupted)
            end_child_processes()
            sys.exit(INTERRUPTED_EXIT_CODE)
        except USER_FAULTS as fault:
            log.error("%s", fault)
            log.error("the traceback of the error above:", exc_info=True, extra=FILE_ONLY)
            end_child_processes()
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            remove_if_untouched(run_dir, dated=dated)
            sys.exit(FAULT_EXIT_CODE)
        except Exception:
            log.error("the run failed:", exc_info=True, extra=FILE_ONLY)  # Hydra prints it on the console
            end_child_processes()
            raise


def refused_before_hydra(check: Callable[[], T]) -> T:
    """``check()``'s result (an entry point's check of its command line before Hydra writes anything); a UserError
    it raises is printed as one message and the process exits with FAULT_EXIT_CODE. There is no log file yet to hold
    a traceback, and the message names the setting and the fix."""
    try:
        return check()
    except UserError as refused:
        print(refused, file=sys.stderr)
        sys.exit(FAULT_EXIT_CODE)


@contextlib.contextmanager
def loader_thread_tracebacks_to_log(log: logging.Logger) -> Iterator[None]:
    """While inside, an exception that ends the DataLoader's pin-memory thread goes to train.log only.

    That thread dies with a traceback of its own when a worker process it reads from is killed; the main
    thread then reports the worker's death as the run's one message (or, should the thread die alone, fails
    with "Pin memory thread exited unexpectedly"). Other threads' exceptions are printed as before.
    """
    printing = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and PIN_MEMORY_THREAD in args.thread.name:
            log.error("the data loader's pin-memory thread stopped:", extra=FILE_ONLY,
                      exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
            return
        printing(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = printing


def end_child_processes() -> None:
    """Kill the worker processes a failed job left running (a loader's, whose iterator a traceback still holds).
    They ignore the stop signals, and multiprocessing's exit handler, which ends them with SIGTERM before it
    waits for them, would wait forever."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)


def remove_if_untouched(run_dir: Path | None, *, dated: bool = False) -> None:
    """A run directory holding only what Hydra put there (the job failed before writing anything) is removed:
    a failed start leaves no empty run behind (its message was on the console)."""
    if run_dir is None or not run_dir.is_dir():
        return
    if {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(run_dir, ignore_errors=True)
        for folder in (run_dir.parent, run_dir.parent.parent) if dated else ():
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
