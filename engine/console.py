"""What reaches the console, and what only the run's train.log; one message per fault; exit codes.

Hydra gives the root logger two handlers: the console and train.log. A record logged with
``extra=FILE_ONLY`` (a recompilation's reason, say) is kept off the console by a filter that
``keep_file_only_off_console`` puts on every console handler, and still reaches the file.

``run_reporting_faults`` runs a job the way train.py's users meet it. A fault the user can fix (a setting, a
path, a data file, a checkpoint, a full disk, another run in the directory: USER_FAULTS) is one message on the
console, without a traceback or the internal exceptions behind it; the traceback goes to train.log (and to the
console too with HYDRA_FULL_ERROR=1). The exit codes (README, "Exit codes"): 0 done; 1 a fault; 128 + N stopped
by signal N after saving its step (143 SIGTERM, 130 SIGINT, 138 SIGUSR1); 130 also for a second Ctrl-C, which
stops at once. Anything else is a bug: its traceback goes to train.log and Hydra prints it once.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

FILE_ONLY = {"file_only": True}


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)


_filter = _NotFileOnly()


def keep_file_only_off_console(logger: logging.Logger | None = None) -> None:
    """Filter FILE_ONLY records out of ``logger``'s (default: the root logger's) console handlers."""
    for handler in (logger or logging.getLogger()).handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if _filter not in handler.filters:
                handler.addFilter(_filter)


FAULT_EXIT_CODE = 1
INTERRUPTED_EXIT_CODE = 130
# What Hydra leaves in a run directory before the job writes anything (the log is named after the script).
HYDRA_FILES = {".hydra", "train.log", "predict.log", "export.log"}


def user_faults() -> tuple[type[BaseException], ...]:
    """The exception types whose message tells the user what to fix (the modules that raise them, imported late)."""
    from .checkpoint import CheckpointError
    from .distributed import CollectiveError
    from .loop import NonFiniteLossError
    from .run_lock import RunDirectoryInUse

    return (ValueError, OSError, CheckpointError, CollectiveError, NonFiniteLossError, RunDirectoryInUse)


def run_reporting_faults(job: Callable[[], object], *, run_dir: Path | None, log: logging.Logger,
                         dated: bool = False,
                         interrupted: str = "stopped at once by a second Ctrl-C: the steps since the last checkpoint "
                                            "are lost") -> None:
    """Run ``job`` (see the module docstring): returns when it succeeds, else exits or re-raises.

    run_dir  Hydra's run directory, removed if the job failed before writing anything into it; ``dated``: it is
             outputs/<date>/<time>, whose date and outputs folders go too when that leaves them empty
    interrupted  the message for a KeyboardInterrupt (a job without stop signals of its own gets it at once)
    """
    from .stop_request import TrainingStopped

    try:
        job()
    except TrainingStopped as stopped:  # the loop has logged where to resume from
        sys.exit(stopped.exit_code)
    except KeyboardInterrupt:
        log.error("%s", interrupted)
        sys.exit(INTERRUPTED_EXIT_CODE)
    except user_faults() as fault:
        log.error("%s", fault)
        log.error("the traceback of the error above:", exc_info=True, extra=FILE_ONLY)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        remove_if_untouched(run_dir, dated=dated)
        sys.exit(FAULT_EXIT_CODE)
    except Exception:
        log.error("the run failed:", exc_info=True, extra=FILE_ONLY)  # Hydra prints it on the console
        raise


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
