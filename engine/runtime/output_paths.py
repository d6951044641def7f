"""The folders and files a command is told to write, checked before it does any work: each check creates the
folder, writes a scratch file into it, or raises one ``OutputPathError`` naming the setting, the path and the cause.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from engine.errors import OutputPathError


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
    return error.strerror or str(error)
