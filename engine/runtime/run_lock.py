"""One run per run directory: ``<run dir>/.run.lock``, created with O_EXCL, records the owner's pid, host, start time
and command, and a second run refuses, naming it. A lock whose process is gone is taken over with a warning; one
held on another host cannot be checked and is refused, saying how to remove it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from engine.errors import RunDirectoryInUse, SettingsError

from .command_line import is_multirun, is_sweep, override_value
from .output_paths import LOCK_FILE, missing_folders, remove_unused_folders, writable_folder

log = logging.getLogger(__name__)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 only asks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to someone else
    return True


class RunLock:
    """``with RunLock(run_dir):`` holds the directory for this process (rank 0 of a run)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # at most one stale lock to take over
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._owner()[1:] == (os.getpid(), socket.gethostname()):
                    return  # taken before Hydra started (held_before_hydra), which releases it
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(
                    {
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "command": " ".join(sys.argv)[:500],
                    },
                    f,
                )
            self.held = True
            return
        raise RunDirectoryInUse(f"{self.path.parent} is being locked and unlocked by another process; try again")

    def _owner(self) -> tuple[dict, int | None, str | None]:
        """The lock file's record, pid and host; ({}, None, None) when unreadable (left by a crash while writing it)."""
        try:
            owner = json.loads(self.path.read_text())
            return owner, int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            return {}, None, None

    def _take_over_if_stale(self) -> None:
        owner, pid, host = self._owner()
        here = socket.gethostname()
        if pid is not None and pid != os.getpid() and (host != here or process_alive(pid)):
            where = f"process {pid}" + (f" on {host}" if host != here else "")
            check = (
                ""
                if host == here
                else f"; this host ({here}) cannot tell whether it still runs: if it does not, delete {self.path}"
            )
            raise RunDirectoryInUse(
                f"run directory {self.path.parent} is in use by {where}, started {owner.get('started', '?')} "
                f"({owner.get('command', '?')}){check}. Wait for it to end, stop it, or choose another output_dir"
            )
        log.warning(
            "run directory %s: taking over the lock of %s, which no longer runs",
            self.path.parent,
            f"process {pid}" if pid is not None else "a process that left it unreadable",
        )
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


class ClaimedDirectory:
    """A run directory a command line names, claimed before Hydra writes there: its lock held (rank 0), and the
    folders made for it (``made``). ``release()`` gives the lock back and removes those folders if nothing was
    written into them (Hydra refused an override, say)."""

    def __init__(self, lock: RunLock, made: list[Path]):
        self.lock, self.made = lock, made

    def release(self) -> None:
        self.lock.release()
        remove_unused_folders(self.made)


def held_before_hydra(argv: list[str]) -> ClaimedDirectory | None:
    """The run directory the command line names (``output_dir=``, or the ``hydra.run.dir=`` it stands for; for a
    multirun, the folder of its jobs: ``hydra.sweep.dir=``), claimed before Hydra writes there, so a refused run
    leaves the live run's files alone; None when it names none (Hydra's dated directory is new). train.py and
    predict.py claim theirs: neither writes into a directory a live run of either holds."""
    multirun = is_multirun(argv)
    named = override_value(argv, ("output_dir", "hydra.sweep.dir" if multirun else "hydra.run.dir"))
    if named is None:
        return None
    key, directory = named
    if is_sweep(key, directory):
        if not multirun:
            return None  # Hydra refuses a sweep without -m, naming it
        raise SettingsError(
            f"{key}={directory}: a multirun (-m) takes one {key}, and runs each job in a folder of its "
            f"own under it ({key}/0, {key}/1, ...); to name each job's folder, run the jobs one by one"
        )
    made = missing_folders(directory)
    lock = RunLock(writable_folder(directory, setting=f"{key}={directory}"))
    try:
        lock.acquire()
    except BaseException:
        remove_unused_folders(made)
        raise
    return ClaimedDirectory(lock, made)
