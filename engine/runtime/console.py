"""One message per fault, and the exit codes (docs/resume-and-faults.md). A fault the user can fix
(engine.errors.USER_FAULTS) is one console message, its traceback in the log file only (on the console too with
HYDRA_FULL_ERROR=1); exit 1. A stop signal N after saving exits 128 + N, a second Ctrl-C 130. Anything else is a
bug: its traceback goes to the log file and Hydra prints it.
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

from .output_paths import HYDRA_FILES
from .stop_request import TrainingStopped

FAULT_EXIT_CODE = 1
INTERRUPTED_EXIT_CODE = 130
# The name torch's DataLoader gives (through its target) the thread that pins batches on a GPU run.
PIN_MEMORY_THREAD = "_pin_memory_loop"
T = TypeVar("T")


def run_reporting_faults(
    job: Callable[[], object],
    *,
    run_dir: Path | None,
    log: logging.Logger,
    dated: bool = False,
    interrupted: str = "stopped at once by a second Ctrl-C: the steps since the last checkpoint are lost",
) -> None:
    """Run ``job`` (module docstring): returns when it succeeds, else exits or re-raises. ``run_dir``: Hydra's run
    directory, removed when a fault leaves it untouched (remove_if_untouched, ``dated``); ``interrupted``: the message
    for a KeyboardInterrupt."""
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
            log.exception("the traceback of the error above:", extra=FILE_ONLY)
            end_child_processes()
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            remove_if_untouched(run_dir, dated=dated)
            sys.exit(FAULT_EXIT_CODE)
        except Exception:
            log.exception("the run failed:", extra=FILE_ONLY)  # Hydra prints it on the console
            end_child_processes()
            raise


def refused_before_hydra(check: Callable[[], T]) -> T:
    """``check()``'s result (a check of the command line before Hydra writes anything); a UserError it raises is
    printed, without a traceback (there is no log file yet), and the process exits with FAULT_EXIT_CODE."""
    try:
        return check()
    except UserError as refused:
        print(refused, file=sys.stderr)
        sys.exit(FAULT_EXIT_CODE)


@contextlib.contextmanager
def loader_thread_tracebacks_to_log(log: logging.Logger) -> Iterator[None]:
    """While inside, an exception that ends the DataLoader's pin-memory thread goes to the log file only: it dies
    when a worker is killed, whose death the main thread reports as the run's one message."""
    printing = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.thread is not None and PIN_MEMORY_THREAD in args.thread.name:
            log.error(
                "the data loader's pin-memory thread stopped:",
                extra=FILE_ONLY,
                exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
            )
            return
        printing(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = printing


def end_child_processes() -> None:
    """Kill the worker processes a failed job left running: they ignore SIGTERM, with which multiprocessing's exit
    handler would end them before waiting forever."""
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)


def remove_if_untouched(run_dir: Path | None, *, dated: bool = False) -> None:
    """Remove ``run_dir`` when it holds only what Hydra put there; ``dated`` (outputs/<date>/<time>): its date and
    outputs folders too when that leaves them empty."""
    if run_dir is None or not run_dir.is_dir():
        return
    if {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(run_dir, ignore_errors=True)
        for folder in (run_dir.parent, run_dir.parent.parent) if dated else ():
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
