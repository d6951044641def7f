"""The folders and files a command is told to write, checked before it does any work: each check creates the
folder, writes a scratch file into it, or raises one ``OutputPathError`` naming the setting, the path and the cause.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from engine.errors import OutputPathError

LOCK_FILE = ".run.lock"  # a run directory's lock (engine/runtime/run_lock.py)
# What a run directory holds before the job writes anything: Hydra's record, the script's log and the run's lock.
HYDRA_FILES = {".hydra", "train.log", "predict.log", "export.log", LOCK_FILE}


def writable_folder(path: str | os.PathLike, *, setting: str) -> Path:
    """``path`` as a folder this process can write into, created with its parents when missing; ``setting`` names
    where the path came from in the message (``output_dir=/proc/runs``)."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        raise OutputPathError(
            f"{setting}: cannot create or write into the folder {path}: {why(path, error)}. "
            "Choose a folder you can write to"
        ) from error
    return path


def job_directory(output_dir: str | None, *, script: str) -> Path:
    """The folder a job writes into, created and checked: ``output_dir`` if set, else Hydra's run directory, and in a
    multirun always Hydra's (the job's own folder under output_dir); ``script`` names the command in the error of a
    job started without Hydra and without output_dir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if output_dir and not multirun:
        chosen = Path(output_dir).expanduser().resolve()
    elif HydraConfig.initialized():
        chosen = Path(HydraConfig.get().runtime.output_dir).resolve()
    else:
        raise ValueError(
            f"output_dir is not set: run through `python {script}` (Hydra picks the run directory) or pass "
            "output_dir=PATH"
        )
    return writable_folder(chosen, setting=f"output_dir={output_dir}" if output_dir else "the run directory")


def missing_folders(path: str | os.PathLike) -> list[Path]:
    """``path`` and those of its parents that do not exist, deepest first: what writable_folder would create."""
    path, missing = Path(path).expanduser().absolute(), []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_unused_folders(folders: list[Path]) -> None:
    """Remove ``folders`` (missing_folders' list, deepest first) where the command that made them wrote nothing there
    but what Hydra writes before a job (HYDRA_FILES: a command Hydra refused, or a job that failed before writing),
    then each parent left empty."""
    for i, folder in enumerate(folders):
        if not folder.is_dir():
            continue  # removed already (engine/runtime/console.py removes a failed job's untouched run directory)
        if i == 0 and {p.name for p in folder.iterdir()} <= HYDRA_FILES:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        try:
            folder.rmdir()
        except OSError:  # the command wrote there
            return


def writable_file(path: str | os.PathLike, *, setting: str, example: str) -> Path:
    """``path`` as a file this process can write: not an existing folder, in a folder it can write into (created
    when missing). ``example``: a file name to suggest when ``path`` is a folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputPathError(f"{setting}: {path} is a folder; name the file to write, e.g. {path / example}")
    writable_folder(path.parent, setting=setting)
    return path


def why(path: Path, error: OSError) -> str:
    """What stops a folder at ``path`` from being created or written, in a few words."""
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            return f"{part} is a file, not a folder"
    cause = error.strerror or str(error)
    if path.is_dir() and not isinstance(error, PermissionError):  # e.g. /proc, whose "no such file" misleads
        return f"the folder exists, but no file can be created in it ({cause})"
    return cause
